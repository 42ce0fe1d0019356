"""Online recalibration: each allocation's measured latency against the step-cost model's.

The DSE and the policy price allocations on the chip model and a serving-stack profile
(:mod:`dse.stacks`). A live deployment can run slower (another software version, a noisy
host, a kernel the profile does not know) or faster. The controller watches every ready vPod's
engine - vLLM's own metrics, which the simulated engines copy - and keeps, per allocation
(chip, pod shape, TP/PP/EP) and phase, a **correction factor** f = measured / predicted:

* decode: the mean TPOT of the requests that finished since the last epoch
  (``vllm:time_per_output_token_seconds`` sum and count) against the model's decode step at
  the batch and KV length the engine actually ran (``vllm:num_requests_running`` and
  ``vllm:kv_cache_usage_perc`` x the vPod's KV capacity, sampled every 10 s, the prediction
  weighted by the sequences each sample ran);
* prefill: the mean TTFT (``vllm:time_to_first_token_seconds``) of intervals in which no
  request waited (``vllm:num_requests_waiting`` = 0 at every sample: no queueing in it) against
  the model's prefill step of the mean prompt (``vllm:prompt_tokens`` / requests) times the
  prompts it ran together.

An epoch with at least :data:`MIN_REQUESTS` finished requests on an allocation updates its
factor by an exponentially weighted mean in log space (weight :data:`ALPHA`), each
measurement's ratio and the factor clipped to [:data:`LOW`, :data:`HIGH`] (one bad scrape
cannot make a group 100x larger). An allocation never observed takes the geometric mean of
the observed factors of its phase (what the software adds tends to hold across allocations):
without it, an unobserved allocation would look faster than the observed ones and the policy
would switch to it for no reason. Factors are kept in the controller's state (SQLite) across
restarts, and ``orchestrator status`` shows them.

:class:`orchestrator.pricing.CalibratedPricer` applies them: the load-aware policy sizes groups
with throughput / f and checks SLOs with latency x f.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ALPHA = 0.5            # weight of the newest epoch's measurement (log space)
LOW, HIGH = 0.5, 4.0   # bounds of a measured ratio and of a factor
MIN_REQUESTS = 8       # finished requests an epoch needs before it moves a factor

Key = tuple[str, str, int, int, int, str, str]   # chip, topology, tp, pp, ep, attn, phase


def _clip(x: float) -> float:
    return min(HIGH, max(LOW, x))


class Calibration:
    """Correction factors by allocation and phase (see the module docstring)."""

    def __init__(self) -> None:
        self.factors: dict[Key, float] = {}
        self.samples: dict[Key, int] = {}     # epochs that moved each factor
        self.version = 0                      # bumped on every change (pricing caches)

    def factor(self, key: Key) -> float:
        f = self.factors.get(key)
        if f is not None:
            return f
        same = [v for k, v in self.factors.items() if k[-1] == key[-1]]
        if not same:
            return 1.0
        return math.exp(sum(math.log(v) for v in same) / len(same))

    def update(self, key: Key, measured_s: float, predicted_s: float) -> float | None:
        """Fold one epoch's measurement in; the new factor (None: the measurement is unusable)."""
        if not (math.isfinite(measured_s) and math.isfinite(predicted_s)
                and measured_s > 0 and predicted_s > 0):
            return None
        r = _clip(measured_s / predicted_s)
        old = self.factors.get(key)
        new = r if old is None else _clip(math.exp((1 - ALPHA) * math.log(old)
                                                   + ALPHA * math.log(r)))
        self.factors[key] = new
        self.samples[key] = self.samples.get(key, 0) + 1
        self.version += 1
        return new

    def to_json(self) -> list[dict[str, Any]]:
        return [{"chip": k[0], "topology": k[1], "tp": k[2], "pp": k[3], "ep": k[4],
                 "attn": k[5], "phase": k[6], "factor": f, "epochs": self.samples.get(k, 0)}
                for k, f in sorted(self.factors.items())]

    @classmethod
    def from_json(cls, rows: Any) -> "Calibration":
        """Factors saved by :meth:`to_json`; malformed rows are skipped (a state file from
        another version must not stop a controller)."""
        c = cls()
        for r in rows if isinstance(rows, list) else []:
            try:
                key = (str(r["chip"]), str(r["topology"]), int(r["tp"]), int(r["pp"]),
                       int(r["ep"]), str(r.get("attn", "dp")), str(r["phase"]))
                f = float(r["factor"])
            except (KeyError, TypeError, ValueError):
                continue
            if math.isfinite(f) and f > 0 and key[6] in ("prefill", "decode"):
                c.factors[key] = _clip(f)
                c.samples[key] = int(r.get("epochs", 0) or 0)
        return c


# ---- measuring ---------------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """The Prometheus samples a recalibration needs, summed over label sets."""
    want = ("vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_count",
            "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
            "vllm:prompt_tokens_total", "vllm:num_requests_running",
            "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    out = dict.fromkeys(want, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            try:
                out[name] += float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                pass
    return out


@dataclass
class _Tally:
    """One vPod's counters at the last epoch and the samples since."""
    base: dict[str, float] | None = None      # cumulative counters at the epoch start
    last: dict[str, float] | None = None      # the latest scrape
    pred_sum: float = 0.0                     # sum over samples of predicted step x weight
    weight: float = 0.0
    queued: bool = False                      # a sample saw waiting requests


@dataclass
class Recalibrator:
    """Feeds :class:`Calibration` from engine scrapes (the controller calls :meth:`observe`
    every sample and :meth:`update` every epoch). ``table_for(key)`` gives an allocation's
    step-cost table (:class:`sim.stepcost.StepCostTable` on the database's stack)."""

    table_for: Any
    calibration: Calibration = field(default_factory=Calibration)
    _tallies: dict[str, tuple[Key, _Tally]] = field(default_factory=dict)

    def observe(self, vpod_id: str, key: Key, text: str) -> None:
        m = parse_metrics(text)
        key_tally = self._tallies.get(vpod_id)
        if key_tally is None or key_tally[0] != key:
            key_tally = self._tallies[vpod_id] = (key, _Tally())
        t = key_tally[1]
        if t.base is None:
            t.base = m
        t.last = m
        n = m["vllm:num_requests_running"]
        if m["vllm:num_requests_waiting"] > 0:
            t.queued = True
        if n <= 0:
            return
        try:
            table = self.table_for(key)
        except Exception:                  # noqa: BLE001 - an allocation the model refuses
            return
        if key[-1] == "decode":
            kv = m["vllm:kv_cache_usage_perc"] * table.kv_capacity_tokens
            if kv <= 0:
                return
            lat = float(table.step(0.0, 0.0, float(n), kv)[0])
            t.pred_sum += lat * n
            t.weight += n
        else:
            t.pred_sum += n                     # prompts per step, averaged below
            t.weight += 1

    def forget(self, vpod_id: str) -> None:
        self._tallies.pop(vpod_id, None)

    def update(self) -> dict[Key, float]:
        """Fold the epoch's measurements in, per allocation; start the next epoch. Returns the
        factors that moved."""
        per_key: dict[Key, list[float]] = {}      # [measured sum, count, predicted sum, weight]
        for vid, (key, t) in list(self._tallies.items()):
            if t.base is None or t.last is None:
                continue
            b, m = t.base, t.last
            acc = per_key.setdefault(key, [0.0, 0.0, 0.0, 0.0])
            if key[-1] == "decode":
                s = m["vllm:time_per_output_token_seconds_sum"] - \
                    b["vllm:time_per_output_token_seconds_sum"]
                c = m["vllm:time_per_output_token_seconds_count"] - \
                    b["vllm:time_per_output_token_seconds_count"]
                if c > 0 and s >= 0 and t.weight > 0:
                    acc[0] += s
                    acc[1] += c
                    acc[2] += t.pred_sum
                    acc[3] += t.weight
            elif not t.queued:
                s = m["vllm:time_to_first_token_seconds_sum"] - \
                    b["vllm:time_to_first_token_seconds_sum"]
                c = m["vllm:time_to_first_token_seconds_count"] - \
                    b["vllm:time_to_first_token_seconds_count"]
                p = m["vllm:prompt_tokens_total"] - b["vllm:prompt_tokens_total"]
                if c > 0 and s >= 0 and p > 0 and t.weight > 0:
                    try:
                        table = self.table_for(key)
                    except Exception:          # noqa: BLE001
                        table = None
                    if table is not None:
                        prompt = p / c
                        together = max(1.0, t.pred_sum / t.weight)
                        tok = prompt * together
                        pred = float(table.step(tok, together * prompt * (prompt + 1) / 2,
                                                0.0, 0.0)[0])
                        acc[0] += s
                        acc[1] += c
                        acc[2] += pred * c
                        acc[3] += c
            self._tallies[vid] = (key, _Tally(base=m, last=m))
        moved = {}
        for key, (s, c, ps, w) in per_key.items():
            if c >= MIN_REQUESTS and w > 0:
                f = self.calibration.update(key, s / c, ps / w)
                if f is not None:
                    moved[key] = f
        return moved
