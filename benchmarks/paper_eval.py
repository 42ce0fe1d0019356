"""The paper's evaluation (§5.2-5.3, §5.7): NeuScale (load-aware), NeuScale (the paper's rule),
Base, Ideal and Ideal-at-load on the four presets x {Azure coding, LV-Eval-like,
OpenThoughts-like} x {energy, cost} x {prefill, decode} = 48 rows, 24-hour replays; and a load
sweep (1, 4, 16, 64 x the load of a window of the Azure coding day: that many copies of its
requests) with a plot of NeuScale / Base against load. Writes one JSON per run (the ``orchestrator simulate --json`` object plus wall
times), prints the README's tables, and plots the sweep.

    python benchmarks/paper_eval.py --out results/ [--jobs 2]          # grid + sweep
    python benchmarks/paper_eval.py --out results/ --table-only        # re-print from the JSONs

A run whose JSON exists is kept (delete it to re-run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse import load_model  # noqa: E402
from dse.catalog import default_catalog  # noqa: E402
from orchestrator.cluster import (ClusterConfig, ClusterSim, ideal_at_load_report,  # noqa: E402
                                  ideal_report)
from orchestrator.pricing import ChipModelPricer  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from rows import replicate  # noqa: E402
from sim.traces import load_trace  # noqa: E402
from sim.verified import verified_db  # noqa: E402

MODELS = "llama3-8b,llama3-70b,llama3.1-405b,deepseek-v3"
TRACES = {"azure-code": "Azure coding", "lveval": "LV-Eval-like",
          "openthoughts": "OpenThoughts-like"}
SIMULATED = ("neuscale", "neuscale-paper", "base")
COLS = ("neuscale", "neuscale-paper", "base", "ideal", "ideal-at-load")
PAPER = {"energy": 1.13, "cost": 1.43, "slo": 1.36}    # §5.2-5.3's geometric means


_PRICERS: dict = {}


def _pricer(model: str, arch, cat, stack) -> ChipModelPricer:
    """One pricer per model and serving stack in a worker process, kept across its runs: the
    chip model's price of an allocation at a length is the same in every run (and in every
    column), so a model's runs share what was priced once - Ideal-at-load prices every Pareto
    point at every loaded length, the bulk of its time."""
    key = (model, getattr(stack, "name", stack))
    if key not in _PRICERS:
        _PRICERS[key] = ChipModelPricer(arch, cat, stack)
    return _PRICERS[key]


def run_one(job: tuple) -> str:
    kind, model, trace, metric, hours, start, scale, out_dir, *rest = job
    rerun = tuple(rest[0]) if rest else ()
    stem = (f"{model}-{trace}-{metric}" if kind == "grid"
            else f"sweep-{model}-{trace}-{metric}-x{scale:g}")
    path = Path(out_dir) / f"{stem}.json"
    kept = None
    if path.exists():
        if not rerun:
            return f"{path} (kept)"
        kept = json.loads(path.read_text())
        if (kept.get("hours"), kept.get("rate_scale")) != (hours, scale):
            raise ValueError(f"{path} was run for {kept.get('hours')} h at "
                             f"x{kept.get('rate_scale')}, not {hours:g} h at x{scale:g}: "
                             "--rerun needs the same grid")
        if kind == "sweep" and kept.get("copies") != "rotated":
            raise ValueError(f"{path} was run with copies shifted, not rotated, within the "
                             "window (before the sweep's first minute was fully loaded): "
                             "--rerun needs the same grid")
    arch, cat = load_model(model), default_catalog()
    db = verified_db(arch, metric, progress=False)
    tr = load_trace(trace, hours=hours if hours < 24 else None, start=start)
    if kept is not None and kept.get("summary") != json.loads(json.dumps(tr.summary())):
        raise ValueError(f"{path} was run on another window of {trace} (its summary "
                         "differs): --rerun needs the same grid")
    arr, inp, out = (np.asarray(tr.arrival_s), np.asarray(tr.input_tokens),
                     np.asarray(tr.output_tokens))
    if kind == "sweep" and scale != 1:
        arr, inp, out = replicate(arr, inp, out, int(scale), hours * 3600.0)
    cfg = ClusterConfig()
    pricer = _pricer(model, arch, cat, db.stack)
    res = {"kind": kind, "model": model, "trace": trace, "metric": metric, "rate_scale": scale,
           "hours": hours, "summary": tr.summary(), "note": tr.note, "policies": {},
           "wall_s": {}, **({"copies": "rotated"} if kind == "sweep" else {})}
    if kept is not None:             # only the named columns again; the others as they were
        res = kept
    for name in SIMULATED:
        if kept is not None and name not in rerun:
            continue
        t = time.perf_counter()
        sim = ClusterSim(arch, db, make_policies(name, db, cfg.policy, inp, out, None, cat,
                                                 pricer), cfg, cat)
        res["policies"][name] = sim.run(arr, inp, out).to_json()
        res["wall_s"][name] = time.perf_counter() - t
    for name, fn in (("ideal", lambda: ideal_report(arch, db, arr, inp, out, cat)),
                     ("ideal-at-load",
                      lambda: ideal_at_load_report(arch, db, arr, inp, out, pricer))):
        if kept is not None and name not in rerun:
            continue
        t = time.perf_counter()
        res["policies"][name] = {ph: r.to_json() for ph, r in fn().items()}
        res["wall_s"][name] = time.perf_counter() - t
    path.write_text(json.dumps(res, indent=1))
    ran = [v for k, v in res["wall_s"].items() if kept is None or k in rerun]
    return f"{path} ({sum(ran):.0f} s{', ' + ','.join(rerun) if kept is not None else ''})"


def _key(metric: str) -> str:
    return "tokens_per_j" if metric == "energy" else "tokens_per_usd"


def gmean(x) -> float:
    x = [v for v in x if np.isfinite(v) and v > 0]
    return float(np.exp(np.mean(np.log(x)))) if x else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def grid_table(out_dir: Path) -> str:
    rows = ["| model | workload | metric | phase | NeuScale | paper rule | Base | Ideal | "
            "Ideal-at-load | NeuScale / Base | paper rule / Base | NeuScale / Ideal-at-load | "
            "NeuScale / Ideal | SLO NeuScale | SLO paper rule | SLO Base |",
            "|" + "---|" * 16]
    eff = {p: {"energy": [], "cost": []} for p in ("neuscale", "neuscale-paper")}
    slo = {p: [] for p in ("neuscale", "neuscale-paper")}
    above = {"ideal": 0, "ideal-at-load": 0}
    losses, n_rows = [], 0
    for f in sorted(out_dir.glob("*.json")):
        r = json.loads(f.read_text())
        if r.get("kind", "grid") != "grid":
            continue
        key, unit = _key(r["metric"]), ("tok/J" if r["metric"] == "energy" else "tok/$")
        for ph in ("prefill", "decode"):
            v = {p: r["policies"][p][ph] for p in COLS}
            n_rows += 1
            for p in eff:
                eff[p][r["metric"]].append(_ratio(v[p][key], v["base"][key]))
                slo[p].append(_ratio(v[p]["slo_rate"], v["base"]["slo_rate"]))
            for o in above:
                above[o] += v["neuscale"][key] >= 0.8 * v[o][key]
            nb = _ratio(v["neuscale"][key], v["base"][key])
            if nb < 1 and v["neuscale"]["slo_rate"] >= v["base"]["slo_rate"] - 1e-3:
                losses.append(f"{r['model']} {TRACES[r['trace']]} {r['metric']} {ph} "
                              f"({nb:.2f}x)")
            rows.append(
                f"| {r['model']} | {TRACES.get(r['trace'], r['trace'])} | {r['metric']} | {ph} "
                f"| {v['neuscale'][key]:.4g} {unit} | {v['neuscale-paper'][key]:.4g} | "
                f"{v['base'][key]:.4g} | {v['ideal'][key]:.4g} | {v['ideal-at-load'][key]:.4g} "
                f"| {nb:.2f}x | {_ratio(v['neuscale-paper'][key], v['base'][key]):.2f}x | "
                f"{_ratio(v['neuscale'][key], v['ideal-at-load'][key]):.2f} | "
                f"{_ratio(v['neuscale'][key], v['ideal'][key]):.2f} | "
                f"{v['neuscale']['slo_rate']:.1%} | {v['neuscale-paper']['slo_rate']:.1%} | "
                f"{v['base']['slo_rate']:.1%} |")
    if not n_rows:                   # a sweep-only --out (--no-grid)
        return ""
    rows.append("")
    for p, label in (("neuscale", "NeuScale"), ("neuscale-paper", "NeuScale (paper rule)")):
        rows.append(f"Geometric means over {n_rows} rows, {label} over Base: energy efficiency "
                    f"{gmean(eff[p]['energy']):.2f}x, cost efficiency {gmean(eff[p]['cost']):.2f}x"
                    f", SLO rate {gmean(slo[p]):.2f}x (paper: {PAPER['energy']}x, "
                    f"{PAPER['cost']}x, {PAPER['slo']}x).")
    rows.append(f"NeuScale at >= 80 % of Ideal-at-load on {above['ideal-at-load']} of {n_rows} "
                f"rows, of Ideal (full batch) on {above['ideal']} of {n_rows} (paper: 22 of 48 "
                "against its Ideal).")
    rows.append("Rows where NeuScale is below Base at an SLO rate not lower: "
                + (", ".join(losses) if losses else "none") + ".")
    return "\n".join(rows)


def sweep_rows(out_dir: Path) -> list[dict]:
    out = []
    for f in sorted(out_dir.glob("sweep-*.json")):
        r = json.loads(f.read_text())
        key = _key(r["metric"])
        for ph in ("prefill", "decode"):
            v = {p: r["policies"][p][ph] for p in COLS}
            out.append({"model": r["model"], "metric": r["metric"], "scale": r["rate_scale"],
                        "phase": ph, **{f"{p}/base": _ratio(v[p][key], v["base"][key])
                                        for p in COLS if p != "base"},
                        "slo": {p: v[p]["slo_rate"] for p in SIMULATED}})
    return sorted(out, key=lambda d: (d["model"], d["metric"], d["phase"], d["scale"]))


def sweep_table(out_dir: Path) -> str:
    rows = ["| model | phase | rate x | NeuScale / Base | paper rule / Base | "
            "Ideal-at-load / Base | SLO NeuScale | SLO paper rule | SLO Base |",
            "|" + "---|" * 9]
    for d in sweep_rows(out_dir):
        s = d["slo"]
        rows.append(f"| {d['model']} ({d['metric']}) | {d['phase']} | {d['scale']:g} | "
                    f"{d['neuscale/base']:.2f}x | {d['neuscale-paper/base']:.2f}x | "
                    f"{d['ideal-at-load/base']:.2f}x | {s['neuscale']:.1%} | "
                    f"{s['neuscale-paper']:.1%} | {s['base']:.1%} |")
    return "\n".join(rows)


def plot_sweep(out_dir: Path) -> Path | None:
    rows = sweep_rows(out_dir)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(d["model"], d["metric"]) for d in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (model, metric) in zip(axes[0], keys):
        for ph, style in (("prefill", "-"), ("decode", "--")):
            sel = [d for d in rows if (d["model"], d["metric"], d["phase"]) == (model, metric, ph)]
            x = [d["scale"] for d in sel]
            for p, c in (("neuscale", "C0"), ("neuscale-paper", "C1"), ("ideal-at-load", "C2")):
                ax.plot(x, [d[f"{p}/base"] for d in sel], style, color=c, marker="o",
                        label=f"{p} {ph}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("load: copies of the window's requests")
        ax.set_ylabel(f"{'tokens/J' if metric == 'energy' else 'tokens/$'} / Base")
        ax.set_title(f"{model} ({metric})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One argparse error line for a name or number the runs could not use (before any
    work starts)."""
    from dse.models import PRESETS
    for flag, text, known in (("--models", args.models, PRESETS),
                              ("--sweep-models", args.sweep_models, PRESETS),
                              ("--traces", args.traces, TRACES),
                              ("--metrics", args.metrics, ("energy", "cost")),
                              ("--sweep-metric", args.sweep_metric, ("energy", "cost"))):
        bad = [x for x in text.split(",") if x not in known]
        if bad:
            ap.error(f"{flag}: unknown {', '.join(bad)}; known: {', '.join(known)}")
    try:
        scales = [float(x) for x in args.sweep_scales.split(",")]
    except ValueError:
        ap.error(f"--sweep-scales: numbers, e.g. 1,4,16,64 (got {args.sweep_scales!r})")
    if any(not (x >= 1 and x == int(x)) for x in scales):
        ap.error("--sweep-scales: whole numbers of copies >= 1")
    for flag, v in (("--hours", args.hours), ("--sweep-hours", args.sweep_hours)):
        if not 0 < v <= 24:
            ap.error(f"{flag} must be in (0, 24] (got {v:g})")
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1 (got {args.jobs})")
    bad = [x for x in args.rerun.split(",") if x and x not in COLS]
    if bad:
        ap.error(f"--rerun: unknown {', '.join(bad)}; known: {', '.join(COLS)}")
    from dse.errors import NeuScaleError
    from sim.traces import _parse_start
    for flag, v in (("--start", args.start), ("--sweep-start", args.sweep_start)):
        try:
            if v is not None:
                _parse_start(v)
        except NeuScaleError as e:
            ap.error(f"{flag}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSONs, tables and plot")
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--metrics", default="energy,cost")
    ap.add_argument("--hours", type=float, default=24.0, help="grid replay length")
    ap.add_argument("--start", default=None, help="grid window start HH:MM (default 00:00)")
    ap.add_argument("--sweep-models", default="llama3-70b,deepseek-v3")
    ap.add_argument("--sweep-scales", default="1,4,16,64")
    ap.add_argument("--sweep-hours", type=float, default=0.25,
                    help="the sweep's window of the Azure coding day (from --sweep-start); "
                    "load x S replays S copies of it, each rotated within the window by a "
                    "random offset under a minute")
    ap.add_argument("--sweep-start", default="12:00")
    ap.add_argument("--sweep-metric", default="energy")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-grid", action="store_true",
                    help="run the load sweep only (the grid's JSONs in --out, if any, kept)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--rerun", default="", metavar="COLUMNS",
                    help="re-run only these columns (comma-separated, of "
                    f"{','.join(COLS)}) in the JSONs --out already holds, keeping the "
                    "others: for a change that touches only those policies (say so beside "
                    "the results); missing JSONs are run whole")
    args = ap.parse_args()
    _check_args(ap, args)
    if args.no_grid and args.no_sweep and not args.table_only:
        ap.error("--no-grid and --no-sweep leave nothing to run")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not args.table_only:
        models, metrics = args.models.split(","), args.metrics.split(",")
        for m in (args.sweep_models.split(",") if args.no_grid else models):
            for metric in ((args.sweep_metric,) if args.no_grid else metrics):
                # build the verified DBs once, before the workers
                verified_db(load_model(m), metric, progress=False)
        rerun = tuple(x for x in args.rerun.split(",") if x)
        jobs = [] if args.no_grid else [
            ("grid", m, t, metric, args.hours, args.start, 1.0, str(out), rerun)
            for m in models for t in args.traces.split(",") for metric in metrics]
        if not args.no_sweep:
            jobs += [("sweep", m, "azure-code", args.sweep_metric, args.sweep_hours,
                      args.sweep_start, float(s), str(out), rerun)
                     for m in args.sweep_models.split(",")
                     for s in args.sweep_scales.split(",")]
        # the longest first, so the pool's tail is short
        jobs.sort(key=lambda j: (j[1] != "deepseek-v3", j[0] != "sweep", -j[6]))
        with get_context("fork").Pool(args.jobs) as pool:
            try:
                for msg in pool.imap_unordered(run_one, jobs):
                    print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)
            except ValueError as e:          # a kept JSON --rerun cannot extend
                pool.terminate()
                ap.exit(2, f"error: {e}\n")
    grid = grid_table(out)
    if grid:
        print(grid)
        print()
    print(sweep_table(out))
    p = plot_sweep(out)
    if p:
        print(f"\nwrote {p}")
    if not args.table_only:
        print(f"total {time.perf_counter() - t0:.0f} s with --jobs {args.jobs}")


if __name__ == "__main__":
    main()
