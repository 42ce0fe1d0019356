"""Plots of a simulation report (paper Figs. 18, 21-22 style): efficiency and SLO attainment per
policy and phase, and vPods per group over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_report(report: dict[str, Any], timelines: dict[str, list[dict[str, Any]]],
                out_dir: str | Path) -> list[Path]:
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
    for name, tl in timelines.items():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, ph in zip(axes, ("prefill", "decode")):
            rows = [r for r in tl if r["phase"] == ph]
            groups = sorted({g for r in rows for g in r["target"]})
            for g in groups:
                ax.step([r["t_s"] / 3600 for r in rows], [r["target"].get(g, 0) for r in rows],
                        where="post", label=g)
            ax.set_title(f"{name} {ph}: vPods per group")
            ax.set_xlabel("time (h)")
            ax.set_ylabel("vPods")
            if len(groups) <= 8:
                ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / f"vpods_{name.replace(':', '-')}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
