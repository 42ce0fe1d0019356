"""What a simulated run reports: per phase the requests, served tokens, energy, dollars and SLO
attainment (paper §5.2-5.3), per minute the ready vPods, energy and SLO rate (Figs. 19-20), and
per request its latencies and energy; plus the Ideal oracle of §5.1 and ratios against Base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

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
            cm = ChipModel.of(arch, catalog, e.chip, e.topology, e.tp, e.pp, e.ep,
                              stack=db.stack, attn=e.attn)
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


def ideal_at_load_report(arch: ModelArch, db: BestFitDB, arrival_s, input_tokens, output_tokens,
                         pricer, epoch_s: float = 300.0, chips: Sequence[str] | None = None,
                         per_request: dict | None = None) -> dict[str, PhaseReport]:
    """The reachable bound beside the paper's full-batch ``ideal``: each epoch (``epoch_s``),
    every phase's load - the mean tokens/s of each sequence bucket - served at the least cost
    any grouping can reach with no provisioning delay and no queueing: buckets split into
    groups of consecutive lengths (routing is by length), each group on the Pareto point (of
    any bucket's front, any chip or ``chips``; :class:`_IdealGrid`) that meets the SLO of all
    its buckets on the chip model, at the batch it holds at each length, and minimises
    ``ceil(sum of rate / throughput)`` vPods' static power (or price) plus the tokens' dynamic
    energy; the split is an exact dynamic programme over the buckets. Every
    request's tokens pay its group's cost per token. A bucket no point meets the SLO of takes
    its fastest point alone (its requests miss the SLO). Requests beyond the largest bucket are
    dropped, as everywhere."""
    metric = db.meta.get("metric", "energy")
    inp = np.asarray(input_tokens, np.int64)
    out = np.asarray(output_tokens, np.int64)
    arr = np.asarray(arrival_s, np.float64)
    longest = db.edges[-1]
    ok = (inp <= longest) & ((out <= 1) | (inp + out <= longest))
    epoch = np.floor(arr / epoch_s).astype(np.int64)
    rep = {ph: PhaseReport() for ph in PHASES}
    multi = out > 1
    per = {ph: np.zeros(len(inp)) for ph in PHASES}
    slo_ok = {ph: np.zeros(len(inp), dtype=bool) for ph in PHASES}
    nb = len(db.edges)
    for ph in PHASES:
        length = inp if ph == "prefill" else inp + out
        tokens = inp if ph == "prefill" else out - 1
        mask = ok & (tokens > 0)
        b = np.searchsorted(np.asarray(db.edges), np.clip(length, 1, longest))
        grid = _IdealGrid(db, pricer, ph, metric, chips, buckets=np.unique(b[mask]).tolist())
        r = rep[ph]
        for e in np.unique(epoch[mask]).tolist():
            sel = mask & (epoch == e)
            rates = np.bincount(b[sel], weights=tokens[sel], minlength=nb) / epoch_s
            prices = grid.solve(rates)           # bucket -> (J/token, $/token, meets SLO)
            j_of, usd_of, met_of = np.zeros(nb), np.zeros(nb), np.zeros(nb, dtype=bool)
            for i, (j, usd, met) in prices.items():
                j_of[i], usd_of[i], met_of[i] = j, usd, met
            idx = np.nonzero(sel)[0]
            n = tokens[idx].astype(np.float64)
            e_req = j_of[b[idx]] * n
            r.energy_j += float(e_req.sum())
            r.cost_usd += float((usd_of[b[idx]] * n).sum())
            per[ph][idx] = e_req
            slo_ok[ph][idx] = met_of[b[idx]]
        r.tokens = int(tokens[mask].sum())
    p, d = rep["prefill"], rep["decode"]
    p.requests, d.requests = len(inp), int(multi.sum())
    p.slo_met = int((slo_ok["prefill"] & ok).sum())
    d.slo_met = int((slo_ok["decode"] & ok & multi).sum())
    p.dropped, d.dropped = int((~ok).sum()), int((multi & ~ok).sum())
    if per_request is not None:
        per_request.update({"input": inp, "output": out, "ttft_s": np.full(len(inp), np.nan),
                            "tpot_s": np.full(len(inp), np.nan),
                            "prefill_energy_j": per["prefill"], "decode_energy_j": per["decode"]})
    return rep


class _IdealGrid:
    """Every Pareto point the database keeps for the phase (every bucket's front, the allowed
    chips), priced at every bucket on the chip model at the batch it holds there: throughput,
    dynamic energy per token, SLO met (with at least one sequence held); static power and
    price. A segment of buckets ending at bucket j may run on any point that meets the SLO of
    each of its buckets - a shorter bucket's point that still meets a longer one's (what a
    running NeuScale group keeps when a longer bucket joins it) as well as a longer one's -
    so the oracle is a bound over every allocation the policy can run. (Until 2026-12-07 it
    took the Pareto points of the segment's longest bucket only, and NeuScale beat it on two
    rows.)"""

    def __init__(self, db: BestFitDB, pricer, phase: str, metric: str, chips,
                 buckets: Sequence[int] | None = None):
        """``buckets``: price the points at these buckets only (the ones the trace loads;
        every bucket by default) - pricing every point at every length is the oracle's cost,
        and :meth:`solve` reads a bucket's column only when it has load. The other columns
        hold no point."""
        from orchestrator.pricing import Alloc
        nb = len(db.edges)
        self.buckets = sorted({int(j) for j in (range(nb) if buckets is None else buckets)
                               if 0 <= int(j) < nb}) or [0]
        self.upto = self.buckets[-1] + 1
        self.db, self.pricer, self.phase, self.metric = db, pricer, phase, metric
        self.chips = list(chips or db.chips)
        self.slo = np.asarray(db.meta["slo_s"][phase])
        self._Alloc = Alloc
        self._all: dict | None = None
        self.allocs: list = []                       # the table's rows, once priced
        self._cands: dict[int, dict | None] = {}

    def _table(self) -> dict:
        """Every distinct Pareto point (rows) priced at every bucket (columns), once."""
        if self._all is None:
            allocs: dict = {}
            for e in self.db.edges:          # every front, a longer bucket's too
                for chip in self.chips:
                    for p in self.db.pareto_for(self.phase, e, chip):
                        allocs.setdefault(self._Alloc(chip, p["topology"], p["num_chips"],
                                                      p["tp"], p["pp"], p["ep"], p["batch"],
                                                      p["attn"]), None)
            n, cols = len(allocs), self.buckets
            t = {k: np.zeros((n, self.upto), dtype=bool if k in ("ok", "fits") else float)
                 for k in ("inv_t", "dyn", "ok", "fits", "lat")}
            t["static_w"], t["usd_s"] = np.zeros(n), np.zeros(n)
            for r, a in enumerate(allocs):
                for j in cols:
                    c = self.pricer.cost(a, self.phase, self.db.edges[j])
                    t["inv_t"][r, j], t["dyn"][r, j] = 1.0 / c.throughput_tok_per_s, \
                        c.dyn_j_per_token
                    t["ok"][r, j] = c.fits and c.latency_s <= self.slo[j]
                    t["fits"][r, j], t["lat"][r, j] = c.fits, c.latency_s
                t["static_w"][r], t["usd_s"][r] = c.static_w, c.usd_per_s
            self._all = t
            self.allocs = list(allocs)               # the rows' allocations, in order
        return self._all

    def cands(self, j: int) -> dict | None:
        """The points that hold a sequence of bucket ``j``'s length, as arrays (rows: points):
        1 / throughput, dynamic energy per token and SLO met at every bucket up to ``j``
        (columns); static power, price per second and latency at ``j``. None without any."""
        if j not in self._cands:
            t = self._table()
            rows = np.nonzero(t["fits"][:, j])[0] if len(t["inv_t"]) else np.zeros(0, int)
            self._cands[j] = None if not rows.size else {
                "inv_t": t["inv_t"][rows, :j + 1], "dyn": t["dyn"][rows, :j + 1],
                "ok": t["ok"][rows, :j + 1], "static_w": t["static_w"][rows],
                "usd_s": t["usd_s"][rows], "lat": t["lat"][rows, j]}
        return self._cands[j]

    def solve(self, rates: np.ndarray) -> dict[int, tuple[float, float, bool]]:
        """(J/token, $/token, SLO met) per active bucket of the cheapest grouping: for each
        last bucket, every point (rows) and first bucket (columns) at once; ties go to the
        earlier point, then the earlier first bucket."""
        act = [int(i) for i in np.nonzero(rates > 0)[0]]
        m = len(act)
        best = np.array([0.0] + [math.inf] * m)   # best[k]: the first k active buckets served
        how: list = [None] * (m + 1)
        for jj in range(m):
            j = act[jj]
            idx = np.array(act[:jj + 1])
            r = rates[idx]
            st = self.cands(j)
            if st is not None:
                valid = np.logical_and.accumulate(st["ok"][:, idx][:, ::-1], axis=1)[:, ::-1]
                # segment ii..jj's demand and dynamic energy, per point
                dem = np.cumsum((r * st["inv_t"][:, idx])[:, ::-1], axis=1)[:, ::-1]
                dj = np.cumsum((r * st["dyn"][:, idx])[:, ::-1], axis=1)[:, ::-1]
                n = np.ceil(dem - 1e-9)
                energy = n * st["static_w"][:, None] + dj
                usd = n * st["usd_s"][:, None]
                total = np.where(valid, best[None, :jj + 1]
                                 + (energy if self.metric == "energy" else usd), np.inf)
                p, ii = divmod(int(np.argmin(total)), jj + 1)
                if total[p, ii] < best[jj + 1]:
                    best[jj + 1] = total[p, ii]
                    how[jj + 1] = (ii, energy[p, ii], usd[p, ii], True)
            if how[jj + 1] is None:          # nothing meets the SLO: the fastest point alone
                f = int(np.argmin(st["lat"]))
                n = max(1, math.ceil(rates[j] * st["inv_t"][f, j] - 1e-9))
                e_ = n * st["static_w"][f] + rates[j] * st["dyn"][f, j]
                u_ = n * st["usd_s"][f]
                best[jj + 1] = best[jj] + (e_ if self.metric == "energy" else u_)
                how[jj + 1] = (jj, e_, u_, False)
        out: dict[int, tuple[float, float, bool]] = {}
        k = m
        while k > 0:
            ii, energy, usd, met = how[k]
            seg = act[ii:k]
            total = float(rates[seg].sum())
            for i in seg:
                out[i] = (energy / total, usd / total, met)
            k = ii
        return out
