"""Figures of a best-fit database: chip rooflines, Pareto fronts and best fit per bucket.

``plot_db(db, out_dir)`` writes PNG files (matplotlib, Agg backend) and returns their paths:

* ``roofline_<metric>.png``: per chip, FLOP/J (metric energy) or FLOP/USD (metric cost) and
  FLOP/s against arithmetic intensity, with each chip's ridge point (paper Fig. 8);
* ``pareto_<phase>_<seq>.png``: latency against efficiency of each chip's Pareto front, the
  SLO and the best-fit allocation (paper Fig. 10);
* ``bestfit_by_bucket.png``: best efficiency per chip and sequence bucket, and the best chip
  of each bucket (paper Fig. 3).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .catalog import ChipSpec, chip_from_mapping
from .errors import NeuScaleError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .db import BestFitDB

__all__ = ["plot_db"]

_DPI = 110
_I_MIN, _I_MAX = 0.1, 1e4          # arithmetic-intensity range of the rooflines (FLOP/byte)
_ANNOTATE_EVERY = 6                # label the best chip of every 6th bucket
_METRIC_AXIS = {"energy": "energy efficiency (FLOP/J)", "cost": "cost efficiency (FLOP/USD)"}


def plot_db(db: BestFitDB, out_dir: str | Path,
            phase_seq_for_roofline: tuple[int, int] = (4096, 512)) -> list[Path]:
    """Write the figures of ``db`` into ``out_dir`` (created) and return their paths.

    ``phase_seq_for_roofline`` is ``(prompt_len, output_len)``: the Pareto figures show the
    prefill bucket holding ``prompt_len`` and the decode bucket holding
    ``prompt_len + output_len``.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = str(db.meta["metric"])
    if metric not in _METRIC_AXIS:
        raise ValueError(f"cannot plot metric {metric!r} (expected one of {sorted(_METRIC_AXIS)})")
    prompt, output = phase_seq_for_roofline
    seqs = {"prefill": int(prompt), "decode": int(prompt) + int(output)}
    for seq in seqs.values():
        db.bucket_index(seq)                        # fail before writing anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = _chip_colors(db.chips)

    paths = [_plot_roofline(plt, db, metric, colors, out / f"roofline_{metric}.png")]
    for phase, seq in seqs.items():
        paths.append(_plot_pareto(plt, db, phase, seq, colors, out / f"pareto_{phase}_{seq}.png"))
    paths.append(_plot_bestfit(plt, db, colors, out / "bestfit_by_bucket.png"))
    return paths


# ---- helpers -------------------------------------------------------------------------------
def _chip_colors(chips: list[str]) -> dict[str, Any]:
    import matplotlib
    cmap = matplotlib.colormaps["tab10"]
    return {c: cmap(i % 10) for i, c in enumerate(chips)}


def _title(db: BestFitDB, what: str) -> str:
    return f"{db.meta['model']}: {what} (metric: {db.meta['metric']})"


def _save(plt: Any, fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey")


# ---- 1. rooflines (Fig. 8) -----------------------------------------------------------------
def _metric_roofline(chip: ChipSpec, metric: str, intensity: np.ndarray) -> np.ndarray:
    """FLOP/J or FLOP/USD of a kernel of arithmetic intensity ``intensity`` on this chip."""
    seconds_per_byte = np.maximum(intensity / chip.peak_flops_per_s, 1.0 / chip.hbm_bw_bytes_per_s)
    if metric == "cost":
        return intensity / chip.vpod_usd(1, seconds_per_byte)
    return intensity / (intensity * chip.e_flop_j + chip.e_hbm_j_per_byte
                        + chip.static_power_w * seconds_per_byte)


def _perf_roofline(chip: ChipSpec, intensity: np.ndarray) -> np.ndarray:
    return np.minimum(chip.peak_flops_per_s, intensity * chip.hbm_bw_bytes_per_s)


def _plot_roofline(plt: Any, db: BestFitDB, metric: str, colors: dict[str, Any],
                   path: Path) -> Path:
    from matplotlib.transforms import blended_transform_factory

    catalog = {str(s["name"]): s for s in db.meta.get("catalog", [])}
    specs = [(c, chip_from_mapping(catalog[c], origin="database catalog"))
             for c in db.chips if c in catalog]
    intensity = np.logspace(np.log10(_I_MIN), np.log10(_I_MAX), 400)
    fig, (ax_m, ax_p) = plt.subplots(1, 2, figsize=(13, 5.2))
    panels = ((ax_m, f"{metric} roofline", _METRIC_AXIS[metric],
               lambda s, i: _metric_roofline(s, metric, i)),
              (ax_p, "performance roofline", "performance (FLOP/s)", _perf_roofline))
    for ax, title, ylabel, curve in panels:
        trans = blended_transform_factory(ax.transData, ax.transAxes)
        for k, (chip, spec) in enumerate(specs):
            color = colors[chip]
            ax.plot(intensity, curve(spec, intensity), color=color, lw=2, label=chip)
            ridge = spec.peak_flops_per_s / spec.hbm_bw_bytes_per_s
            ax.axvline(ridge, color=color, ls=":", lw=1.2)
            ax.plot([ridge], curve(spec, np.array([ridge])), "o", color=color, ms=6)
            ax.text(ridge * 1.06, 0.04 + 0.07 * k, f"{chip} ridge\nI={ridge:.0f}",
                    transform=trans, color=color, fontsize=8, va="bottom")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(_I_MIN, _I_MAX)
        ax.set_xlabel("arithmetic intensity I (FLOP/byte)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="major", alpha=0.3)
        if specs:
            ax.legend(title="chip", loc="upper left", fontsize=9)
        else:
            _no_data(ax, "no chip specs in the database catalog")
    fig.suptitle(_title(db, "chip rooflines"))
    fig.tight_layout()
    return _save(plt, fig, path)


# ---- 2. Pareto fronts (Fig. 10) ------------------------------------------------------------
def _plot_pareto(plt: Any, db: BestFitDB, phase: str, seq: int, colors: dict[str, Any],
                 path: Path) -> Path:
    edge = db.edges[db.bucket_index(seq)]
    fig, ax = plt.subplots(figsize=(8.5, 5.8))
    slos: list[float] = []
    plotted = False
    for chip in db.chips:
        front = [p for p in db.pareto_for(phase, seq, chip)
                 if p["latency_s"] > 0 and p["efficiency"] > 0]
        if not front:
            continue
        front.sort(key=lambda p: p["latency_s"])
        color = colors[chip]
        ax.plot([p["latency_s"] for p in front], [p["efficiency"] for p in front], "o-",
                color=color, ms=4, lw=1.2, alpha=0.85, label=f"{chip} Pareto front")
        plotted = True
        try:
            best = db.lookup(phase, seq, chip)
        except NeuScaleError:
            continue
        if not best.feasible:
            continue
        slos.append(best.slo_s)
        ax.plot([best.latency_s], [best.efficiency], "*", ms=17, mec="black", mew=0.8,
                color=color if best.meets_slo else "white", zorder=5,
                label=f"{chip} best fit: {best.topology} tp{best.tp} pp{best.pp}"
                      + ("" if best.meets_slo else " (misses SLO)"))
    for k, slo in enumerate(sorted({round(s, 12) for s in slos})):
        ax.axvline(slo, color="black", ls="--", lw=1.2,
                   label=f"SLO {slo * 1e3:.3g} ms" if k == 0 else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(("TTFT" if phase == "prefill" else "TPOT") + " latency (s)")
    ax.set_ylabel(f"efficiency ({db.meta['efficiency_unit']})")
    ax.grid(True, which="both", alpha=0.25)
    if plotted:
        ax.legend(fontsize=8, loc="best")
    else:
        _no_data(ax, "no feasible configuration")
    ax.set_title(_title(db, f"{phase} Pareto fronts, seq {seq} (bucket <= {edge})"))
    fig.tight_layout()
    return _save(plt, fig, path)


# ---- 3. best fit per bucket (Fig. 3) -------------------------------------------------------
def _plot_bestfit(plt: Any, db: BestFitDB, colors: dict[str, Any], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.8))
    edges = np.array(db.edges, dtype=float)
    for ax, phase in zip(axes, ("prefill", "decode")):
        for chip in db.chips:
            eff = np.full(len(edges), np.nan)       # NaN breaks the line at infeasible buckets
            for e in db.entries_for(phase, chip):
                if e.feasible and e.efficiency > 0:
                    eff[db.bucket_index(e.seq_len)] = e.efficiency
            if np.isfinite(eff).any():
                ax.plot(edges, eff, "-", color=colors[chip], lw=1.6, label=chip)
        best = [e for e in db.entries_for(phase) if e.feasible and e.efficiency > 0]
        for chip in db.chips:
            mine = [e for e in best if e.chip == chip]
            if mine:
                ax.plot([e.seq_len for e in mine], [e.efficiency for e in mine], "o",
                        color=colors[chip], mec="black", mew=0.6, ms=5, zorder=4,
                        label=f"best chip: {chip}")
        for e in best:
            if db.bucket_index(e.seq_len) % _ANNOTATE_EVERY == 0:
                ax.annotate(f"{e.chip}_{e.topology}_tp{e.tp}_pp{e.pp}",
                            (e.seq_len, e.efficiency), xytext=(0, 10),
                            textcoords="offset points", rotation=45, fontsize=7,
                            ha="left", va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence-length bucket upper edge (tokens)")
        ax.set_ylabel(f"best efficiency ({db.meta['efficiency_unit']})")
        ax.set_title(phase)
        ax.grid(True, which="major", alpha=0.3)
        if best:
            lo, hi = ax.get_ylim()                  # headroom for the rotated labels
            ax.set_ylim(lo, hi * (hi / lo) ** 0.45)
            ax.legend(fontsize=8, loc="lower left", ncol=2)
        else:
            _no_data(ax, "no feasible configuration")
    fig.suptitle(_title(db, "best fit per sequence bucket"))
    fig.tight_layout()
    return _save(plt, fig, path)
