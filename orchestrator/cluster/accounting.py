"""What a simulated run reports: per phase the requests, served tokens, energy, dollars and SLO
attainment (paper §5.2-5.3), per minute the ready vPods, energy and SLO rate (Figs. 19-20), and
per request its latencies and energy; plus the Ideal oracle of §5.1 and ratios against Base.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from dse.catalog import Catalog, default_catalog
from dse.db import BestFitDB
from dse.errors import NeuScaleError
from dse.models import ModelArch
from sim.chip import ChipModel

PHASES = ("prefill", "decode")


@dataclass
class PhaseReport:
    requests: int = 0
    tokens: int = 0
    energy_j: float = 0.0
    cost_usd: float = 0.0
    slo_met: int = 0
    vpod_hours: dict[str, float] = field(default_factory=dict)
    failovers: int = 0
    migrations: int = 0
    dropped: int = 0      # never served (no vPod could hold it or none came): SLO misses

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "tokens": self.tokens, "energy_j": self.energy_j,
                "cost_usd": self.cost_usd,
                "tokens_per_j": self.tokens / self.energy_j if self.energy_j else 0.0,
                "tokens_per_usd": self.tokens / self.cost_usd if self.cost_usd else 0.0,
                "slo_rate": self.slo_met / self.requests if self.requests else 0.0,
                "vpod_hours": self.vpod_hours, "failovers": self.failovers,
                "migrations": self.migrations, "dropped": self.dropped}


class Migration(NamedTuple):
    request: int          # index into the result's (sorted) request arrays
    src: str              # group it leaves
    dst: str              # group it moves to
    length: int           # its length (prompt + generated) when it moves
    t_s: float


@dataclass
class SimResult:
    """One policy's run. Request arrays are in arrival order (the trace sorted by arrival);
    latencies are NaN for requests never served (dropped)."""
    reports: dict[str, PhaseReport]
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray                    # 0 for one-token outputs
    request_energy_j: dict[str, np.ndarray]
    timeline: list[dict[str, Any]]        # per epoch and phase: the policy's targets
    minutes: list[dict[str, Any]]         # per minute and phase: vPods, energy, SLO rate
    migrations: list[Migration]
    vpods: list[Any]                      # the fleet's SimVPods (life-cycle times, chips)
    end_s: float

    def to_json(self) -> dict[str, Any]:
        return {ph: r.to_json() for ph, r in self.reports.items()}

    def per_request(self) -> dict[str, np.ndarray]:
        return {"input": self.input_tokens, "output": self.output_tokens, "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s, **{f"{ph}_energy_j": e for ph, e in
                                          self.request_energy_j.items()}}


def phase_reports(fleet, t_end: float, arr, inp, out, ttft, tpot, slo_p, slo_d,
                  migrations: int) -> dict[str, PhaseReport]:
    """Energy, dollars and vPod-hours of every vPod; requests, served tokens and SLO hits.
    ``slo_p`` / ``slo_d``: each request's prefill / decode SLO."""
    rep = {ph: PhaseReport() for ph in PHASES}
    for v in fleet.vpods.values():
        r = rep[v.phase]
        stop = v.released_s if v.released_s is not None else t_end
        r.energy_j += fleet.energy_j(v, stop)
        r.cost_usd += fleet.cost_usd(v, stop)
        held_s = max(0.0, stop - v.created_s)
        r.vpod_hours[v.chip] = r.vpod_hours.get(v.chip, 0.0) + held_s / 3600
        r.failovers += int(v.failover)
    p, d = rep["prefill"], rep["decode"]
    p.requests = len(arr)
    served = np.isfinite(ttft)          # dropped requests produce no tokens
    p.tokens = int(inp[served].sum())
    p.slo_met = int(np.sum(ttft <= slo_p))
    multi = out > 1
    d.requests = int(multi.sum())
    d.tokens = int((out[multi & np.isfinite(tpot)] - 1).sum())
    d.slo_met = int(np.sum((tpot <= slo_d) & multi))
    d.migrations = migrations
    p.dropped = int(np.isnan(ttft).sum())
    d.dropped = int((np.isnan(tpot) & multi).sum())
    return rep


def bin_minutes(minutes: list[dict[str, Any]], finish_s: dict[str, np.ndarray],
                met: dict[str, np.ndarray]) -> None:
    """Add to each minute row the requests of its phase that finished in it (minute k holds
    finish times in (60k, 60k + 60]) and the share that met the SLO."""
    bins = {}
    for ph in PHASES:
        fin_s, ok = finish_s[ph], met[ph]
        good = np.isfinite(fin_s)
        k = np.maximum(np.ceil(fin_s[good] / 60.0).astype(np.int64) - 1, 0)
        size = int(k.max()) + 1 if len(k) else 0
        bins[ph] = (np.bincount(k, minlength=size), np.bincount(k, weights=ok[good],
                                                                minlength=size))
    for m in minutes:
        cnt, ok = bins[m["phase"]]
        k = int(round(m["t_s"] / 60.0)) - 1
        m["finished"] = int(cnt[k]) if k < len(cnt) else 0
        m["slo_rate"] = float(ok[k] / cnt[k]) if m["finished"] else None


def ratios_vs_base(policies: dict[str, dict[str, dict[str, Any]]]
                   ) -> dict[str, dict[str, dict[str, float | None]]]:
    """Every policy's tokens/J, tokens/$ and SLO rate over Base's, per phase."""
    b = policies["base"]
    return {n: {ph: {k: (v[ph][k] / b[ph][k] if b[ph][k] else None)
                     for k in ("tokens_per_j", "tokens_per_usd", "slo_rate")}
                for ph in PHASES} for n, v in policies.items()}


def ideal_report(arch: ModelArch, db: BestFitDB, arrival_s, input_tokens, output_tokens,
                 catalog: Catalog | None = None, per_request: dict | None = None
                 ) -> dict[str, PhaseReport]:
    """The oracle of §5.1: every request on its best-fit vPod in a full batch of its own length,
    priced on the chip model (energy and dollars per token at the best fit's max batch).
    ``per_request`` (a dict) receives each request's energy and the best fit's latency."""
    catalog = catalog or default_catalog()
    inp = np.asarray(input_tokens, np.int64)
    out = np.asarray(output_tokens, np.int64)
    cache: dict[tuple[str, int], tuple[float, float, float]] = {}

    def per_token(phase: str, length: int) -> tuple[float, float, float]:
        i = db.bucket_index(int(length))
        key = (phase, i)
        if key not in cache:
            e = db.entry_at(phase, i)
            if e is None or not e.feasible:
                raise NeuScaleError(f"no {phase} best fit at {length} tokens")
            c = catalog.get(e.chip)
            cm = ChipModel.of(arch, catalog, e.chip, e.topology, e.tp, e.pp, e.ep)
            r = cm.step(phase, e.max_batch, db.edges[i])
            cache[key] = (r.energy_j / r.tokens, c.vpod_usd(e.num_chips, r.cycle_s) / r.tokens,
                          e.latency_s)
        return cache[key]

    rep = {ph: PhaseReport() for ph in PHASES}
    p, d = rep["prefill"], rep["decode"]
    n = len(inp)
    e_p, e_d, l_p, l_d = (np.zeros(n) for _ in range(4))
    # a request longer than the largest bucket has no best fit at all: dropped, as in the
    # simulator (no tokens served, an SLO miss)
    longest = db.edges[-1]
    ok = (inp <= longest) & ((out <= 1) | (inp + out <= longest))
    for k, (x, y) in enumerate(zip(inp.tolist(), out.tolist())):
        if not ok[k]:
            l_p[k] = l_d[k] = np.nan         # never served; it used no energy
            continue
        ej, usd, lat = per_token("prefill", x)
        p.energy_j += ej * x
        p.cost_usd += usd * x
        e_p[k], l_p[k] = ej * x, lat
        if y > 1:
            ej, usd, lat = per_token("decode", x + y)
            d.energy_j += ej * (y - 1)
            d.cost_usd += usd * (y - 1)
            e_d[k], l_d[k] = ej * (y - 1), lat
    if per_request is not None:
        per_request.update({"input": inp, "output": out, "ttft_s": l_p, "tpot_s": l_d,
                            "prefill_energy_j": e_p, "decode_energy_j": e_d})
    multi = out > 1
    p.requests, p.tokens, p.slo_met = len(inp), int(inp[ok].sum()), int(ok.sum())
    d.requests, d.tokens = int(multi.sum()), int((out[multi & ok] - 1).sum())
    d.slo_met = int((multi & ok).sum())
    p.dropped, d.dropped = int((~ok).sum()), int((multi & ~ok).sum())
    return rep
