"""Plots of a simulation report: efficiency and SLO attainment per policy and phase (Fig. 18),
energy and SLO rate per minute (Fig. 19 a, b, d, e), vPods per group per minute (Fig. 20) and
per-request energy and latency against sequence length (Fig. 19 c, f)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_report(report: dict[str, Any], timelines: dict[str, list[dict[str, Any]]],
                out_dir: str | Path, minutes: dict[str, list[dict[str, Any]]] | None = None,
                per_request: dict[str, dict[str, Any]] | None = None, db=None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    pols = list(report["policies"])
    key = "tokens_per_j" if report.get("metric", "energy") == "energy" else "tokens_per_usd"
    unit = "tokens/J" if key == "tokens_per_j" else "tokens/USD"
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    for col, ph in enumerate(("prefill", "decode")):
        eff = [report["policies"][p][ph][key] for p in pols]
        slo = [100 * report["policies"][p][ph]["slo_rate"] for p in pols]
        axes[0, col].bar(pols, eff, color="tab:blue")
        axes[0, col].set_title(f"{ph}: efficiency")
        axes[0, col].set_ylabel(unit)
        axes[0, col].set_yscale("log")
        axes[1, col].bar(pols, slo, color="tab:green")
        axes[1, col].set_title(f"{ph}: SLO satisfaction")
        axes[1, col].set_ylabel("% of requests")
        axes[1, col].set_ylim(0, 105)
        for ax in axes[:, col]:
            ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"{report.get('model', '')}: policies compared ({report.get('metric', '')})")
    fig.tight_layout()
    p = out / "efficiency_slo.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    if minutes:
        paths.append(_plot_minutes(plt, minutes, out / "minutes.png"))
        for name, rows in minutes.items():
            paths.append(_plot_groups(plt, name, rows, "vpods", "ready vPods per group",
                                      out / f"vpods_{name.replace(':', '-')}.png"))
    if per_request and db is not None:
        paths.append(_plot_vs_length(plt, per_request, db, report.get("model", ""),
                                     out / "vs_length.png"))
    for name, tl in timelines.items():
        paths.append(_plot_groups(plt, name, tl, "target", "vPods per group (policy target)",
                                  out / f"targets_{name.replace(':', '-')}.png"))
        if any(x.get("lengths") for x in tl):
            paths.append(_plot_allocations(plt, name, tl,
                                           out / f"allocations_{name.replace(':', '-')}.png"))
    return paths


def _plot_allocations(plt, name: str, rows, path: Path) -> Path:
    """Per epoch and phase, the lengths each group serves (a bar over its bucket range),
    coloured by chip version and labelled with the allocation and its vPod target: which
    allocation the policy chose for which lengths, over time."""
    import math
    fig, axes = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True)
    chips: dict[str, str] = {}
    for ax, ph in zip(axes, ("prefill", "decode")):
        r = [x for x in rows if x["phase"] == ph]
        for k, x in enumerate(r):
            t0 = x["t_s"] / 3600
            t1 = r[k + 1]["t_s"] / 3600 if k + 1 < len(r) else t0 + (
                (r[1]["t_s"] - r[0]["t_s"]) / 3600 if len(r) > 1 else 1 / 12)
            prev = r[k - 1].get("lengths", {}) if k else {}
            for g, (lo, hi) in sorted(x.get("lengths", {}).items()):
                chip = g.split(":", 1)[0]
                color = chips.setdefault(chip, f"C{len(chips) % 10}")
                y0, y1 = math.log2(max(lo, 1)), math.log2(hi)
                ax.broken_barh([(t0, t1 - t0)], (y0, max(y1 - y0, 0.3)), facecolors=color,
                               edgecolors="white", linewidth=0.3, alpha=0.8)
                if prev.get(g) != (lo, hi):      # label where a group's range starts/changes
                    alloc = g.split(":", 1)[-1]
                    ax.text(t0, (y0 + y1) / 2, f"{chip}:{alloc} x{x['target'].get(g, 0)}",
                            fontsize=5, va="center")
        ax.set_ylabel("length served (log2 tokens)")
        ax.set_title(f"{name} {ph}: the allocation each group runs, by the lengths it serves")
    axes[-1].set_xlabel("time (h)")
    from matplotlib.patches import Patch
    axes[0].legend(handles=[Patch(color=c, label=k) for k, c in chips.items()], fontsize=7,
                   loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_minutes(plt, minutes, path: Path) -> Path:
    """Energy per minute and SLO rate per minute, per policy (Fig. 19 a, b, d, e)."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex=True)
    for name, rows in minutes.items():
        for col, ph in enumerate(("prefill", "decode")):
            r = [x for x in rows if x["phase"] == ph]
            t = [x["t_s"] / 3600 for x in r]
            axes[0, col].plot(t, [x["energy_j"] / 1e6 for x in r], lw=0.8, label=name)
            axes[1, col].plot(t, [100 * x["slo_rate"] if x.get("slo_rate") is not None
                                  else float("nan") for x in r], lw=0.8, label=name)
    for col, ph in enumerate(("prefill", "decode")):
        axes[0, col].set_title(f"{ph}: energy per minute")
        axes[0, col].set_ylabel("MJ")
        axes[1, col].set_title(f"{ph}: SLO satisfaction per minute")
        axes[1, col].set_ylabel("% of finished requests")
        axes[1, col].set_ylim(0, 105)
        axes[1, col].set_xlabel("time (h)")
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_groups(plt, name: str, rows, key: str, what: str, path: Path) -> Path:
    """vPods per group over time, from rows holding ``t_s``, ``phase`` and a group -> count
    dict under ``key`` (per-minute ready vPods: Fig. 20; per-epoch targets)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, ph in zip(axes, ("prefill", "decode")):
        r = [x for x in rows if x["phase"] == ph]
        groups = sorted({g for x in r for g in x[key]})
        t = [x["t_s"] / 3600 for x in r]
        for g in groups:
            ax.step(t, [x[key].get(g, 0) for x in r], where="post", lw=0.8, label=g)
        ax.set_title(f"{name} {ph}: {what}")
        ax.set_xlabel("time (h)")
        ax.set_ylabel("vPods")
        if groups and len(groups) <= 8:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_vs_length(plt, per_request, db, model: str, path: Path) -> Path:
    """Mean energy per token and median latency / SLO per sequence bucket (Fig. 19 c, f):
    prefill against the input length, decode against input + output."""
    import numpy as np

    from router.routing import bucket_indices
    edges = np.asarray(db.edges)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for name, d in per_request.items():
        inp = np.asarray(d["input"], dtype=np.int64)
        out = np.asarray(d["output"], dtype=np.int64)
        for col, ph in enumerate(("prefill", "decode")):
            length = inp if ph == "prefill" else inp + out
            tokens = inp if ph == "prefill" else out - 1
            lat = np.asarray(d["ttft_s" if ph == "prefill" else "tpot_s"], dtype=np.float64)
            energy = np.asarray(d[f"{ph}_energy_j"], dtype=np.float64)
            slo = np.asarray(db.meta["slo_s"][ph])
            b = bucket_indices(db.edges, length)
            ok = tokens > 0
            xs, ys, zs = [], [], []
            for k in np.unique(b[ok]):
                m = ok & (b == k)
                xs.append(edges[k])
                ys.append(energy[m].sum() / tokens[m].sum())
                served = lat[m][np.isfinite(lat[m])]     # (none: every one dropped, or Ideal)
                zs.append(float(np.median(served)) / slo[k] if served.size else np.nan)
            axes[0, col].plot(xs, ys, marker=".", lw=0.8, label=name)
            axes[1, col].plot(xs, zs, marker=".", lw=0.8, label=name)
    for col, ph in enumerate(("prefill", "decode")):
        what = "input" if ph == "prefill" else "input + output"
        axes[0, col].set_title(f"{ph}: energy per token (steps it was in)")
        axes[0, col].set_ylabel("J / token")
        axes[1, col].set_title(f"{ph}: median {'TTFT' if ph == 'prefill' else 'TPOT'} / SLO")
        axes[1, col].axhline(1.0, color="grey", lw=0.6, ls="--")
        for ax in axes[:, col]:
            ax.set_xscale("log")
            ax.set_xlabel(f"{what} length (bucket, tokens)")
            ax.legend(fontsize=7)
        axes[0, col].set_yscale("log")
    fig.suptitle(f"{model}: per-request energy and latency vs sequence length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
