"""The DSE pipeline (paper §3.3): enumerate -> per-chip cost -> roofline -> SLO -> Pareto -> DB.

1. Candidates per chip version: every power-of-two pod shape up to 1024 chips, every valid
   TP x PP (x EP) split of it, every batch bucket; rejected when the per-chip memory (weights +
   KV cache + activations) exceeds HBM, the reason counted for ``--explain``.
2. Per-chip FLOPs from lowered XLA graphs (fitted polynomials, cached), HBM bytes from the fused
   traffic model, ICI from the torus (see :mod:`dse.costmodel`).
3. Roofline latency / throughput / energy / dollars for each candidate at each bucket.
4. SLO per bucket and phase: ``slo_scale`` x the batch-1 latency on the smallest v5p or v6e vPod
   that fits (fewest chips, best split), whichever is faster (§2.4).
5. Pareto front of (latency, efficiency) per bucket x phase x chip; best-fit = the most efficient
   SLO-compliant point, else the lowest-latency one (flagged).
6. Everything is written to one versioned file (:class:`dse.db.BestFitDB`).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .version import __version__
from .buckets import BATCH_BUCKETS, SEQ_BUCKETS
from .catalog import Catalog, ChipSpec, default_catalog
from .costmodel import (BOUNDS, HBM_USABLE_FRACTION, METRICS, PHASES, REASONS, CostModel, OnChip, Parallelism,
                        Roofline, collectives, enumerate_parallelisms, infeasible_message,
                        latency_efficiency, on_chip, roofline)
from .costmodel import MODEL_VERSION
from .db import DB_FORMAT, DB_FORMAT_VERSION, BestFitDB, Entry
from .errors import NeuScaleError
from .stacks import DEFAULT_STACK, StackProfile, get_stack
from .models import ModelArch, load_model
from .pareto import best_fit, pareto_front
from .vpod import ICITopology, enumerate_topologies
from .xla_cost import FitCache, default_workers, jax_version

SLO_REFERENCE_CHIPS = ("v5p", "v6e")  # §2.4: "NPU-C or NPU-D, whichever is faster"
MAX_VPOD_CHIPS = 1024                 # §3.3: "we limit the number of chips per pod to 1024"
PARETO_COLUMNS = ["topology", "num_chips", "tp", "pp", "ep", "attn", "batch", "latency_s",
                  "efficiency"]


@dataclass(frozen=True)
class BuildOptions:
    metric: str = "energy"
    slo_scale: float = 5.0
    chips: tuple[str, ...] | None = None
    max_chips: int = MAX_VPOD_CHIPS
    batches: tuple[int, ...] = BATCH_BUCKETS
    buckets: tuple[int, ...] = SEQ_BUCKETS
    workers: int = field(default_factory=default_workers)
    ray_address: str | None = None
    progress: bool | None = None     # None: a bar when stderr is a terminal
    stack: str = DEFAULT_STACK       # serving-stack profile (dse.stacks) the vPods will run


@dataclass(frozen=True)
class Candidate:
    chip: ChipSpec
    topo: ICITopology
    par: Parallelism


class _Bar:
    def __init__(self, enabled: bool | None, total: int, desc: str):
        self.bar = None
        if enabled or (enabled is None and sys.stderr.isatty()):
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class DSE:
    """Holds a model's cost model and evaluates candidates (shared by build, cost, plot)."""

    def __init__(self, arch: ModelArch, catalog: Catalog | None = None,
                 cache: FitCache | None = None, stack: "StackProfile | str | None" = None):
        self.arch = arch
        self.stack = get_stack(stack)
        self.catalog = catalog or default_catalog()
        self.fits = cache or FitCache(arch)
        self.cost = CostModel(arch, self.fits)
        self._oc: dict[tuple, OnChip] = {}

    def candidates(self, chip: ChipSpec, max_chips: int = MAX_VPOD_CHIPS) -> list[Candidate]:
        out = []
        for topo in enumerate_topologies(chip, max_chips):
            for par in enumerate_parallelisms(self.arch, topo.num_chips,
                                              self.stack.moe_layouts):
                out.append(Candidate(chip, topo, par))
        return out

    def ensure_fits(self, pars, workers: int = 1, ray_address: str | None = None,
                    progress: bool | None = None) -> int:
        keys = CostModel.fit_keys(self.arch, sorted(set(pars)))
        missing = self.fits.missing(keys)
        if not missing:
            return 0
        bar = _Bar(progress, len(missing), f"lowering {self.arch.name} shards (XLA)")
        try:
            return self.fits.fill(keys, workers=workers, ray_address=ray_address,
                                  progress=bar.update)
        finally:
            bar.close()

    def on_chip(self, chip: ChipSpec, par: Parallelism, phase: str, B: np.ndarray,
                S: np.ndarray) -> OnChip:
        key = (chip.name, par, phase, B.tobytes(), S.tobytes())
        oc = self._oc.get(key)
        if oc is None:
            oc = on_chip(self.cost.work(par, phase, B, S), chip)
            self._oc[key] = oc
        return oc

    def latency_efficiency(self, cand: Candidate, phase: str, B: np.ndarray, S: np.ndarray,
                           metric: str):
        oc = self.on_chip(cand.chip, cand.par, phase, B, S)
        lat, eff = latency_efficiency(oc, collectives(cand.topo, cand.chip, cand.par), metric,
                                      self.stack)
        return lat, eff, oc

    def evaluate(self, cand: Candidate, phase: str, B: np.ndarray, S: np.ndarray) -> Roofline:
        oc = self.on_chip(cand.chip, cand.par, phase, B, S)
        return roofline(oc.work, cand.chip, cand.topo, oc, self.stack)

    def forget(self, work: bool = True) -> None:
        """Drop cached evaluations (keeps memory flat across chips and phases)."""
        self._oc.clear()
        if work:
            self.cost._work_cache.clear()


def slo_references(dse: DSE, opts: BuildOptions, ref_chips: list[ChipSpec], phase: str
                   ) -> tuple[np.ndarray, list[Candidate | None]]:
    """Per bucket, the batch-1 latency of the SLO reference allocation and the allocation: the
    smallest fitting vPod of each reference chip (best split), the faster of the chips (§2.4)."""
    S = np.asarray(opts.buckets, dtype=np.int64)
    B1 = np.asarray([1])
    best = np.full(len(S), np.inf)
    refs: list[Candidate | None] = [None] * len(S)
    for chip in ref_chips:
        # smallest chip count first; for each bucket, the first count with a feasible split
        by_n: dict[int, list[Candidate]] = defaultdict(list)
        for c in dse.candidates(chip, opts.max_chips):
            by_n[c.topo.num_chips].append(c)
        settled = np.zeros(len(S), bool)
        usable = HBM_USABLE_FRACTION * chip.hbm_bytes
        for n in sorted(by_n):
            lat_n = np.full(len(S), np.inf)
            arg_n: list[Candidate | None] = [None] * len(S)
            for c in by_n[n]:
                if dse.cost.max_weights_bytes(c.par) > usable:
                    continue
                lat, _, oc = dse.latency_efficiency(c, phase, B1, S, opts.metric)
                lat = np.where(oc.feasible[0], lat[0], np.inf)
                for j in np.flatnonzero(lat < lat_n):
                    arg_n[j] = c
                lat_n = np.minimum(lat_n, lat)
            new = ~settled & np.isfinite(lat_n)
            for j in np.flatnonzero(new & (lat_n < best)):
                best[j], refs[j] = lat_n[j], arg_n[j]
            settled |= new
            if settled.all():
                break
    if not np.isfinite(best).all():
        bad = [int(s) for s, b in zip(S, best) if not np.isfinite(b)]
        raise NeuScaleError(
            f"{dse.arch.name} does not fit on any {'/'.join(c.name for c in ref_chips)} vPod "
            f"of <= {opts.max_chips} chips at {phase} length(s) {bad[:3]}"
            f"{'...' if len(bad) > 3 else ''}: the SLO reference cannot be set")
    return best, refs


def compute_slo(dse: DSE, opts: BuildOptions, ref_chips: list[ChipSpec],
                phases: tuple[str, ...] = PHASES) -> dict[str, np.ndarray]:
    """slo_scale x min over reference chips of the batch-1 latency on the smallest fitting vPod."""
    return {ph: slo_references(dse, opts, ref_chips, ph)[0] * opts.slo_scale for ph in phases}


def build(model: str | ModelArch, opts: BuildOptions = BuildOptions(),
          catalog: Catalog | None = None, log: Callable[[str], None] | None = None
          ) -> BestFitDB:
    t0 = time.perf_counter()
    if opts.metric not in METRICS:
        raise NeuScaleError(f"metric must be one of {', '.join(METRICS)} (got {opts.metric!r})")
    if not opts.slo_scale > 0:
        raise NeuScaleError(f"--slo-scale must be > 0 (got {opts.slo_scale})")
    arch = model if isinstance(model, ModelArch) else load_model(model)
    catalog = catalog or default_catalog()
    chips = catalog.resolve(opts.chips)
    ref = [catalog.get(n) for n in SLO_REFERENCE_CHIPS if n in catalog.names()] or chips
    stack = get_stack(opts.stack)
    dse = DSE(arch, catalog, stack=stack)
    log = log or (lambda s: None)

    all_chips = list(dict.fromkeys(chips + ref))
    cands = {c.name: dse.candidates(c, opts.max_chips) for c in all_chips}
    # weights alone decide whether a model can fit at all: check before lowering anything
    fits_somewhere = [c for c in chips if any(
        dse.cost.max_weights_bytes(cd.par) <= HBM_USABLE_FRACTION * c.hbm_bytes
        for cd in cands[c.name])]
    if not fits_somewhere:
        raise NeuScaleError(
            f"{arch.name} ({arch.weight_bytes() / 1e9:,.0f} GB of bf16 weights) does not fit on "
            f"any vPod of <= {opts.max_chips} chips of {', '.join(c.name for c in chips)}: "
            "add chips with more HBM (--chips) or raise --max-chips")
    pars = {cd.par for cs in cands.values() for cd in cs}
    n_low = dse.ensure_fits(pars, workers=opts.workers, ray_address=opts.ray_address,
                            progress=opts.progress)
    t_fit = time.perf_counter()
    log(f"XLA fits: {n_low} lowered, {len(dse.fits.fits)} cached ({t_fit - t0:.1f}s)")

    total = sum(len(cands[c.name]) for c in chips)
    bar = _Bar(opts.progress, total * len(PHASES), f"roofline {arch.name}")
    slo: dict[str, list[float]] = {}
    entries: list[Entry] = []
    pareto: dict[str, list[list[Any]]] = {}
    explain: dict[str, dict[str, Any]] = {}
    global _SWEEP
    _SWEEP = (dse, chips, cands, opts, ref)
    try:
        if opts.workers > 1 and "jax" not in sys.modules and "ray" not in sys.modules:
            # prefill and decode are independent sweeps: one forked process each. Forking is
            # safe because the DSE parent never imports JAX (lowering runs in workers); a
            # process that has JAX loaded (threads) sweeps sequentially instead.
            import concurrent.futures as cf
            import multiprocessing as mp
            with cf.ProcessPoolExecutor(max_workers=2,
                                        mp_context=mp.get_context("fork")) as ex:
                results = list(ex.map(_phase_sweep, PHASES))
                bar.update(total * len(PHASES))
        else:
            results = [_phase_sweep(ph, bar.update) for ph in PHASES]
    finally:
        _SWEEP = None
    for phase, (slo_p, ent, par_, exp) in zip(PHASES, results):
        slo[phase] = slo_p
        entries += ent
        pareto.update(par_)
        explain.update(exp)
    bar.close()

    if not any(e.feasible for e in entries):
        raise NeuScaleError(f"{arch.name} does not fit on any vPod of <= {opts.max_chips} chips "
                            f"of {', '.join(c.name for c in chips)}")
    fits = list(dse.fits.fits.values())
    meta = {
        "format": DB_FORMAT, "format_version": DB_FORMAT_VERSION, "tool_version": __version__,
        "cost_model_version": MODEL_VERSION,
        "stack": stack.to_json(),
        "model": arch.name, "model_hash": arch.fingerprint(), "model_arch": arch.to_json(),
        "metric": opts.metric, "slo_scale": opts.slo_scale,
        "efficiency_unit": "tokens/J" if opts.metric == "energy" else "tokens/USD",
        "chips": [c.name for c in chips],
        "chip_aliases": {c.name: list(c.aliases) for c in chips},
        "catalog_hash": catalog.fingerprint(), "catalog": [c.to_json() for c in chips],
        "jax_version": jax_version(), "created_utc": datetime.now(timezone.utc).isoformat(),
        "buckets": list(opts.buckets), "batch_buckets": list(opts.batches),
        "max_vpod_chips": opts.max_chips,
        "slo_s": slo,
        "slo_reference_chips": [c.name for c in ref],
        "pareto_columns": PARETO_COLUMNS,
        "fit_quality": {
            "fits": len(fits),
            "heldout_max_rel_err": max((f.heldout_max_rel_err for f in fits), default=0.0),
            "analytic_max_rel_diff": max((f.analytic_max_rel_diff for f in fits), default=0.0)},
        "build_seconds": round(time.perf_counter() - t0, 3),
    }
    log(f"built {len(entries)} entries in {meta['build_seconds']:.1f}s")
    return BestFitDB(meta, entries, pareto, explain)


_SWEEP: tuple | None = None   # (dse, chips, candidates, options, SLO reference chips)


def _phase_sweep(phase: str, progress: Callable[[int], None] | None = None):
    """SLO, Pareto fronts and best fits of one phase for every chip (picklable result)."""
    dse, chips, cands, opts, ref = _SWEEP
    slo = compute_slo(dse, opts, ref, (phase,))[phase]
    B = np.asarray(opts.batches, dtype=np.int64)
    S = np.asarray(opts.buckets, dtype=np.int64)
    entries: list[Entry] = []
    pareto: dict[str, list[list[Any]]] = {}
    explain: dict[str, dict[str, Any]] = {}
    for chip in chips:
        cs = cands[chip.name]
        # [bucket, candidate, batch]: each bucket's slice is contiguous
        lat = np.empty((len(S), len(cs), len(B)))
        eff = np.empty_like(lat)
        feas = np.empty(lat.shape, bool)
        reason = np.empty(lat.shape, np.int8)
        by_par: dict[Parallelism, list[int]] = defaultdict(list)
        for i, c in enumerate(cs):
            by_par[c.par].append(i)
        usable = HBM_USABLE_FRACTION * chip.hbm_bytes
        for par, ii in by_par.items():
            if dse.cost.max_weights_bytes(par) > usable:  # nothing fits: skip the grid
                lat[:, ii, :], eff[:, ii, :] = np.inf, 0.0
                feas[:, ii, :], reason[:, ii, :] = False, REASONS.index("weights")
            else:
                oc = dse.on_chip(chip, par, phase, B, S)
                li, ei = latency_efficiency(
                    oc, [collectives(cs[i].topo, chip, par) for i in ii], opts.metric, dse.stack)
                shape = (len(ii), len(B), len(S))  # no collectives: no topology axis yet
                lat[:, ii, :] = np.broadcast_to(li, shape).transpose(2, 0, 1)
                eff[:, ii, :] = np.broadcast_to(ei, shape).transpose(2, 0, 1)
                feas[:, ii, :] = oc.feasible.T[:, None, :]
                reason[:, ii, :] = oc.reason.T[:, None, :]
            if progress:
                progress(len(ii))
        _select(dse, chip, phase, cs, B, S, lat, eff, feas, reason, slo, opts, entries, pareto,
                explain)
        dse.forget(work=False)
    dse.forget(work=True)
    return [float(x) for x in slo], entries, pareto, explain


def _select(dse: DSE, chip: ChipSpec, phase: str, cs: list[Candidate], B, S, lat, eff, feas,
            reason, slo, opts: BuildOptions, entries, pareto, explain) -> None:
    nB = len(B)
    chips_of = np.array([c.topo.num_chips for c in cs])
    for j, s in enumerate(S):
        key = f"{phase}|{int(s)}|{chip.name}"
        f = feas[j].ravel()
        idx = np.flatnonzero(f)
        rs = reason[j].ravel()[~f]
        counts = {REASONS[k]: int((rs == k).sum()) for k in range(len(REASONS))}
        l_all = lat[j].ravel()
        e_all = eff[j].ravel()
        ex: dict[str, Any] = {"candidates": int(f.size), "feasible": int(idx.size),
                              "infeasible": counts,
                              "slo_violations": int((l_all[idx] > slo[j]).sum())}
        if (~f).any():
            # the largest vPod that still does not fit, at batch 1: why smaller ones fail too
            bad = np.flatnonzero(~f)
            at_b1 = bad[bad % nB == 0]
            bad = at_b1 if at_b1.size else bad
            k = int(bad[np.argmax(chips_of[bad // nB])])
            c = cs[k // nB]
            r = dse.on_chip(chip, c.par, phase, B, S)
            ex["example"] = (f"{chip.name}:{c.topo} {c.par} batch {int(B[k % nB])}: "
                             + infeasible_message(r, chip, (k % nB, j)))
        explain[key] = ex
        if idx.size == 0:
            entries.append(Entry(phase, int(s), chip.name, "-", 0, 0, 0, 0, 0, float("inf"), 0.0,
                                 float("inf"), float("inf"), 0.0, float(slo[j]), False, "-", "-",
                                 0.0, feasible=False))
            continue
        front = idx[pareto_front(l_all[idx], e_all[idx])]
        pareto[key] = [[str(cs[q // nB].topo), cs[q // nB].topo.num_chips, cs[q // nB].par.tp,
                        cs[q // nB].par.pp, cs[q // nB].par.ep, cs[q // nB].par.attn,
                        int(B[q % nB]), float(l_all[q]), float(e_all[q])] for q in front]
        k_rel, ok = best_fit(l_all[idx], e_all[idx], float(slo[j]))
        q = idx[k_rel]
        c, bi = cs[q // nB], q % nB
        r = dse.evaluate(c, phase, B, S)
        entries.append(Entry(
            phase=phase, seq_len=int(s), chip=chip.name, topology=str(c.topo),
            num_chips=c.topo.num_chips, tp=c.par.tp, pp=c.par.pp, ep=c.par.ep, attn=c.par.attn,
            max_batch=int(B[bi]), latency_s=float(r.latency_s[bi, j]),
            throughput_tok_per_s=float(r.throughput_tok_per_s[bi, j]),
            energy_j_per_token=float(r.energy_j_per_token[bi, j]),
            usd_per_token=float(r.usd_per_token[bi, j]), efficiency=float(e_all[q]),
            slo_s=float(slo[j]), meets_slo=bool(ok), bound=BOUNDS[int(r.bound[bi, j])],
            accelerator_type=chip.accelerator_type(c.topo.num_chips),
            hbm_bytes_per_chip=float(r.mem_bytes[bi, j])))


def default_db_path(model: str, metric: str) -> Path:
    name = Path(model).parent.name if model.endswith("config.json") else Path(model).stem
    return Path(f"bestfit-{name}-{metric}.json")


__all__ = ["BuildOptions", "DSE", "Candidate", "build", "compute_slo", "slo_references",
           "default_db_path", "SLO_REFERENCE_CHIPS", "MAX_VPOD_CHIPS"]
