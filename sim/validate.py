"""Roofline (DSE) predictions judged against the chip model (paper Figs. 9, 10, 11).

For one bucket and phase, every candidate allocation (chip x pod shape x TP/PP/EP x batch) that
fits in memory is costed twice: by the roofline the DSE uses and by the per-operator chip model.
We report the rank (Spearman rho) and linear (Pearson r) correlation of latency and efficiency
(Fig. 9), and how many of the chip model's Pareto-optimal allocations the roofline's predicted
front contains (Fig. 10). :func:`allocation_accuracy` does Fig. 11: per bucket, the chip-model
efficiency of the roofline's best fit over the chip model's own best (oracle), both under the
SLO measured the same way (``slo_scale`` x the batch-1 latency of the reference vPod, §2.4).

Large models have tens of thousands of candidates per bucket and the chip model costs ~0.4 ms
each, so ``max_candidates`` caps the evaluated set: a deterministic random sample that always
includes the roofline's Pareto front and best fit. Fronts and the oracle are computed on that set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dse.buckets import BATCH_BUCKETS, SEQ_BUCKETS, bucket_of
from dse.builder import DSE, SLO_REFERENCE_CHIPS, BuildOptions, Candidate, slo_references
from dse.catalog import Catalog, default_catalog
from dse.costmodel import HBM_USABLE_FRACTION, PHASES
from dse.errors import NeuScaleError
from dse.stacks import StackProfile, get_stack
from dse.models import ModelArch
from dse.pareto import best_fit, pareto_front

from .chip import ChipModel


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (for Spearman's rho)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x), dtype=np.float64)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=r)
    return sums[inv] / counts[inv]


def pearson(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def spearman(a, b) -> float:
    return pearson(ranks(a), ranks(b))


@dataclass
class Point:
    cand: Candidate
    batch: int
    pred_latency_s: float
    pred_eff: float
    sim_latency_s: float = 0.0
    sim_eff: float = 0.0

    def label(self) -> str:
        c = self.cand
        return f"{c.chip.name}:{c.topo} {c.par} b{self.batch}"


def _arrays(points: list[Point]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Predicted latency and efficiency, then simulated latency and efficiency, of the points."""
    return tuple(np.array([getattr(p, k) for p in points])
                 for k in ("pred_latency_s", "pred_eff", "sim_latency_s", "sim_eff"))


@dataclass
class Validation:
    model: str
    phase: str
    seq_len: int
    metric: str
    points: list[Point]
    spearman_latency: float
    pearson_latency: float
    spearman_eff: float
    pearson_eff: float
    true_front: list[int]
    predicted_front: list[int]
    candidates_total: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def front_coverage(self) -> float:
        t = set(self.true_front)
        return len(t & set(self.predicted_front)) / len(t) if t else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "phase": self.phase, "seq_len": self.seq_len,
            "metric": self.metric, "candidates_feasible": self.candidates_total,
            "candidates_evaluated": len(self.points),
            "latency": {"spearman_rho": self.spearman_latency, "pearson_r": self.pearson_latency},
            "efficiency": {"spearman_rho": self.spearman_eff, "pearson_r": self.pearson_eff},
            "pareto": {"true_points": len(self.true_front),
                       "predicted_points": len(self.predicted_front),
                       "true_points_covered": len(set(self.true_front) &
                                                  set(self.predicted_front)),
                       "coverage": self.front_coverage,
                       "true_front": [self.points[i].label() for i in self.true_front],
                       "predicted_front": [self.points[i].label() for i in self.predicted_front]},
            "sim_over_roofline_latency_median": float(np.median(
                [p.sim_latency_s / p.pred_latency_s for p in self.points])),
            **self.extra}


class Validator:
    def __init__(self, arch: ModelArch, catalog: Catalog | None = None, metric: str = "energy",
                 chips: list[str] | None = None, workers: int = 2,
                 stack: "StackProfile | str | None" = None):
        self.arch = arch
        self.stack = get_stack(stack)
        self.catalog = catalog or default_catalog()
        self.metric = metric
        self.chips = self.catalog.resolve(chips)
        self.dse = DSE(arch, self.catalog, stack=self.stack)
        self.cands = [c for chip in self.chips for c in self.dse.candidates(chip)]
        self.dse.ensure_fits({c.par for c in self.cands}, workers=workers, progress=False)
        self._models: dict[tuple, ChipModel] = {}

    def chip_model(self, c: Candidate) -> ChipModel:
        key = (c.chip.name, c.topo, c.par)
        m = self._models.get(key)
        if m is None:
            m = self._models[key] = ChipModel(self.arch, c.chip, c.topo, c.par, self.stack)
        return m

    def simulate(self, c: Candidate, phase: str, batch: int, seq_len: int) -> tuple[float, float]:
        r = self.chip_model(c).step(phase, batch, seq_len)
        if self.metric == "energy":
            eff = r.tokens / r.energy_j
        else:
            eff = r.tokens / c.chip.vpod_usd(c.par.chips, r.cycle_s)
        return r.latency_s, eff

    def predicted(self, phase: str, seq_len: int) -> list[Point]:
        """Every memory-feasible candidate of the bucket with its roofline prediction."""
        B = np.asarray(BATCH_BUCKETS)
        S = np.asarray([seq_len])
        pts = []
        for c in self.cands:
            if self.dse.cost.max_weights_bytes(c.par) > HBM_USABLE_FRACTION * c.chip.hbm_bytes:
                continue
            r = self.dse.evaluate(c, phase, B, S)
            eff = (r.tokens / (r.energy_j if self.metric == "energy" else r.cost_usd))[:, 0]
            for i in np.flatnonzero(r.feasible[:, 0]):
                pts.append(Point(c, int(B[i]), float(r.latency_s[i, 0]), float(eff[i])))
        return pts

    def validate(self, phase: str, seq_len: int, max_candidates: int = 3000, seed: int = 0,
                 progress: Callable[[int], None] | None = None) -> Validation:
        if phase not in PHASES:
            raise NeuScaleError(f"phase must be 'prefill' or 'decode' (got {phase!r})")
        s = bucket_of(seq_len)
        pts = self.predicted(phase, s)
        if not pts:
            raise NeuScaleError(f"nothing of {self.arch.name} fits {phase} at {s} tokens")
        total = len(pts)
        lat = np.array([p.pred_latency_s for p in pts])
        eff = np.array([p.pred_eff for p in pts])
        keep = set(pareto_front(lat, eff).tolist())
        if total > max_candidates:
            rng = np.random.default_rng(seed)
            rest = [i for i in range(total) if i not in keep]
            n_more = max(0, max_candidates - len(keep))
            keep |= set(rng.choice(rest, size=min(n_more, len(rest)), replace=False).tolist())
        else:
            keep = set(range(total))
        pts = [pts[i] for i in sorted(keep)]
        for p in pts:
            p.sim_latency_s, p.sim_eff = self.simulate(p.cand, phase, p.batch, s)
            if progress:
                progress(1)
        pl, pe, sl, se = _arrays(pts)
        return Validation(self.arch.name, phase, s, self.metric, pts,
                          spearman(pl, sl), pearson(pl, sl), spearman(pe, se), pearson(pe, se),
                          sorted(pareto_front(sl, se).tolist()),
                          sorted(pareto_front(pl, pe).tolist()), total)

    # ---- Fig. 11 ----------------------------------------------------------------------------
    def slo_pair(self, phase: str, seq_len: int, slo_scale: float) -> tuple[float, float]:
        """(roofline SLO, chip-model SLO) for the bucket: the same reference allocation (the
        smallest fitting v5p/v6e vPod at batch 1, best split by the roofline), timed by each."""
        ref = [self.catalog.get(n) for n in SLO_REFERENCE_CHIPS if n in self.catalog.names()]
        opts = BuildOptions(slo_scale=slo_scale, buckets=(seq_len,), metric=self.metric,
                            stack=self.stack.name)
        lat, cands = slo_references(self.dse, opts, ref, phase)
        sim_lat = self.simulate(cands[0], phase, 1, seq_len)[0]
        return slo_scale * float(lat[0]), slo_scale * sim_lat

    def allocation_accuracy(self, phase: str, buckets: list[int] | None = None,
                            slo_scale: float = 5.0, max_candidates: int = 600, seed: int = 0,
                            progress: Callable[[int], None] | None = None) -> list[dict]:
        rows = []
        for s in buckets or list(SEQ_BUCKETS):
            v = self.validate(phase, s, max_candidates, seed)
            slo_roof, slo_sim = self.slo_pair(phase, s, slo_scale)
            pl, pe, sl, se = _arrays(v.points)
            k, _ = best_fit(pl, pe, slo_roof)
            o, ok = best_fit(sl, se, slo_sim)
            chosen_ok = bool(sl[k] <= slo_sim)
            rows.append({"seq_len": s, "predicted_best": v.points[k].label(),
                         "oracle_best": v.points[o].label(),
                         "predicted_best_sim_eff": float(se[k]), "oracle_sim_eff": float(se[o]),
                         "ratio": float(se[k] / se[o]), "predicted_meets_sim_slo": chosen_ok,
                         "oracle_meets_sim_slo": ok, "slo_roofline_s": slo_roof,
                         "slo_sim_s": slo_sim})
            if progress:
                progress(1)
        return rows


def plot_validation(v: Validation, out_dir) -> list:
    """Fig. 9 (predicted vs simulated latency and efficiency) and Fig. 10 (fronts)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chips = sorted({p.cand.chip.name for p in v.points})
    colors = dict(zip(chips, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, (name, pk, sk, rho, r) in zip(axes, [
            ("latency (s)", "pred_latency_s", "sim_latency_s", v.spearman_latency,
             v.pearson_latency),
            ("efficiency", "pred_eff", "sim_eff", v.spearman_eff, v.pearson_eff)]):
        for c in chips:
            xs = [getattr(p, pk) for p in v.points if p.cand.chip.name == c]
            ys = [getattr(p, sk) for p in v.points if p.cand.chip.name == c]
            ax.scatter(xs, ys, s=6, alpha=0.5, color=colors[c], label=c)
        lo = min(min(getattr(p, pk), getattr(p, sk)) for p in v.points)
        hi = max(max(getattr(p, pk), getattr(p, sk)) for p in v.points)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"roofline {name}")
        ax.set_ylabel(f"chip model {name}")
        ax.set_title(f"{name}: Spearman rho={rho:.3f}, Pearson r={r:.3f}")
        ax.legend(fontsize=8)
    fig.suptitle(f"{v.model} {v.phase} {v.seq_len} tokens ({v.metric}): prediction accuracy")
    fig.tight_layout()
    p = out / f"validate_accuracy_{v.phase}_{v.seq_len}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, (lk, ek, title) in zip(axes, [("pred_latency_s", "pred_eff", "predicted"),
                                          ("sim_latency_s", "sim_eff", "chip model")]):
        ax.scatter([getattr(p, lk) for p in v.points], [getattr(p, ek) for p in v.points],
                   s=4, color="0.8", label="candidates")
        for idx, mk, lab in ((v.predicted_front, "o", "predicted front"),
                             (v.true_front, "x", "true front")):
            pts = sorted((getattr(v.points[i], lk), getattr(v.points[i], ek)) for i in idx)
            if pts:
                ax.plot(*zip(*pts), mk + "-", ms=4, lw=0.8, label=lab)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("latency (s)")
        ax.set_ylabel("efficiency")
        ax.set_title(f"{title} (coverage {v.front_coverage:.0%})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / f"validate_pareto_{v.phase}_{v.seq_len}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def verify_db(db, arch: ModelArch, catalog: Catalog | None = None,
              progress: Callable[[int], None] | None = None):
    """A copy of ``db`` whose best fits are checked on the chip model (paper §3.3: "testing an
    allocation on real hardware is necessary to guarantee SLO ... we only need to test a few
    Pareto-optimal allocations").

    For every (phase, bucket, chip) the roofline's Pareto front is walked from the most efficient
    point down; the first allocation whose chip-model latency meets the bucket's SLO becomes the
    best fit, with the chip model's latency, throughput, energy and dollars per token. If none
    does, the fastest on the chip model, flagged ``meets_slo=False``."""
    from dataclasses import replace as dc_replace

    from dse.db import BestFitDB
    catalog = catalog or default_catalog()
    metric = db.meta["metric"]
    stack = db.stack
    entries = []
    for e in db.entries:
        if not e.feasible:
            entries.append(e)
            continue
        chip = catalog.get(e.chip)
        best = None
        for p in sorted(db.pareto_for(e.phase, e.seq_len, e.chip),
                        key=lambda p: -p["efficiency"]):
            cm = ChipModel.of(arch, catalog, e.chip, p["topology"], p["tp"], p["pp"], p["ep"],
                              stack=stack, attn=p["attn"])
            r = cm.step(e.phase, p["batch"], e.seq_len)
            usd_tok = chip.vpod_usd(cm.par.chips, r.cycle_s) / r.tokens
            cand = (r.latency_s <= e.slo_s, p, r, usd_tok)
            if cand[0]:
                best = cand
                break
            if best is None or r.latency_s < best[2].latency_s:
                best = cand
        ok, p, r, usd_tok = best
        eff = 1 / r.energy_j_per_token if metric == "energy" else 1 / usd_tok
        entries.append(dc_replace(
            e, topology=p["topology"], num_chips=p["num_chips"], tp=p["tp"], pp=p["pp"],
            ep=p["ep"], attn=p["attn"], max_batch=p["batch"], latency_s=r.latency_s,
            throughput_tok_per_s=r.throughput_tok_per_s,
            energy_j_per_token=r.energy_j_per_token, usd_per_token=usd_tok, efficiency=eff,
            meets_slo=bool(ok), bound=r.bound,
            accelerator_type=chip.accelerator_type(p["num_chips"]),
            hbm_bytes_per_chip=r.hbm_bytes_per_chip))
        if progress:
            progress(1)
    cols, pareto = verify_pareto(db, arch, catalog)
    meta = dict(db.meta, verified="chip-model", pareto_columns=cols)
    return BestFitDB(meta, entries, pareto, db.explain)


#: what :func:`verify_pareto` adds to every Pareto point: its chip-model latency, throughput and
#: whether it meets its bucket's SLO there - the points a load-aware policy may pick
CHIP_MODEL_COLUMNS = ["cm_latency_s", "cm_throughput_tok_per_s", "cm_meets_slo"]


def verify_pareto(db, arch: ModelArch, catalog: Catalog) -> tuple[list[str], dict]:
    """Every Pareto point of ``db`` checked on the chip model at its own bucket and batch
    (not only the best fits: a load-aware policy picks among all of them). Returns the
    columns and the rows with :data:`CHIP_MODEL_COLUMNS` appended (replacing earlier ones)."""
    cols = [c for c in db.meta["pareto_columns"] if c not in CHIP_MODEL_COLUMNS]
    keep = [db.meta["pareto_columns"].index(c) for c in cols]
    models: dict[tuple, ChipModel] = {}
    stack = db.stack
    out = {}
    for key, rows in db.pareto.items():
        phase, edge, chip = key.split("|")
        slo = db.meta["slo_s"][phase][db.bucket_index(int(edge))]
        new_rows = []
        for row in rows:
            p = dict(zip(db.meta["pareto_columns"], row))
            k = (chip, p["topology"], p["tp"], p["pp"], p["ep"], p.get("attn", "dp"))
            cm = models.get(k)
            if cm is None:
                cm = models[k] = ChipModel.of(arch, catalog, *k[:5], stack=stack, attn=k[5])
            r = cm.step(phase, p["batch"], int(edge))
            new_rows.append([row[i] for i in keep]
                            + [r.latency_s, r.throughput_tok_per_s, bool(r.latency_s <= slo)])
        out[key] = new_rows
    return cols + CHIP_MODEL_COLUMNS, out
