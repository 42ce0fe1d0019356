"""The paper's evaluation (§5.2-5.3): NeuScale, Base and Ideal on {deepseek-v3, llama3-70b} x
{Azure coding, LV-Eval-like, OpenThoughts-like} x {energy, cost}, 24-hour replays, prefill and
decode. Writes one JSON per run (the ``orchestrator simulate --json`` object) and prints the
README's results table.

    python benchmarks/paper_eval.py --out results/ [--jobs 2] [--hours 24]
    python benchmarks/paper_eval.py --out results/ --table-only      # re-print from the JSONs
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
from orchestrator.cluster import ClusterConfig, ClusterSim, ideal_report  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from sim.verified import verified_db  # noqa: E402
from sim.traces import load_trace  # noqa: E402

TRACES = {"azure-code": "Azure coding", "lveval": "LV-Eval-like",
          "openthoughts": "OpenThoughts-like"}


def run_one(job: tuple[str, str, str, float, str]) -> str:
    model, trace, metric, hours, out_dir = job
    path = Path(out_dir) / f"{model}-{trace}-{metric}.json"
    if path.exists():
        return f"{path} (kept)"
    arch = load_model(model)
    db = verified_db(arch, metric, progress=False)
    tr = load_trace(trace, hours=hours if hours < 24 else None)
    arr, inp, out = (np.asarray(tr.arrival_s), np.asarray(tr.input_tokens),
                     np.asarray(tr.output_tokens))
    cfg = ClusterConfig()
    res = {"model": model, "trace": trace, "metric": metric, "summary": tr.summary(),
           "note": tr.note, "policies": {}, "wall_s": {}}
    for name in ("neuscale", "base"):
        t = time.perf_counter()
        sim = ClusterSim(arch, db, make_policies(name, db, cfg.policy, inp, out), cfg)
        rep = sim.run(arr, inp, out)
        res["wall_s"][name] = time.perf_counter() - t
        res["policies"][name] = rep.to_json()
    rep = ideal_report(arch, db, arr, inp, out)
    res["policies"]["ideal"] = {ph: r.to_json() for ph, r in rep.items()}
    path.write_text(json.dumps(res, indent=1))
    return f"{path} ({sum(res['wall_s'].values()):.0f} s)"


def table(out_dir: Path) -> str:
    rows = ["| model | workload | metric | phase | NeuScale eff. | Base eff. | Ideal eff. | "
            "NeuScale / Base | NeuScale / Ideal | SLO NeuScale | SLO Base |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = {"eff": {"energy": [], "cost": []}, "slo": []}
    for f in sorted(out_dir.glob("*.json")):
        r = json.loads(f.read_text())
        key = "tokens_per_j" if r["metric"] == "energy" else "tokens_per_usd"
        unit = "tok/J" if r["metric"] == "energy" else "tok/$"
        for ph in ("prefill", "decode"):
            n, b, i = (r["policies"][p][ph] for p in ("neuscale", "base", "ideal"))
            rn = n[key] / b[key] if b[key] else float("nan")
            ratios["eff"][r["metric"]].append(rn)
            ratios["slo"].append(n["slo_rate"] / b["slo_rate"] if b["slo_rate"] else np.nan)
            rows.append(f"| {r['model']} | {TRACES.get(r['trace'], r['trace'])} | {r['metric']} "
                        f"| {ph} | {n[key]:.4g} {unit} | {b[key]:.4g} | {i[key]:.4g} | "
                        f"{rn:.2f}x | {n[key] / i[key]:.2f} | {n['slo_rate']:.1%} | "
                        f"{b['slo_rate']:.1%} |")

    def gmean(x):
        x = [v for v in x if np.isfinite(v) and v > 0]
        return float(np.exp(np.mean(np.log(x)))) if x else float("nan")
    rows.append("")
    rows.append(f"Geometric means over the rows: energy efficiency "
                f"{gmean(ratios['eff']['energy']):.2f}x, cost efficiency "
                f"{gmean(ratios['eff']['cost']):.2f}x, SLO rate {gmean(ratios['slo']):.2f}x "
                f"NeuScale over Base (paper: 1.13x, 1.43x, 1.36x).")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="deepseek-v3,llama3-70b")
    ap.add_argument("--traces", default="azure-code,lveval,openthoughts")
    ap.add_argument("--metrics", default="energy,cost")
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        models, metrics = args.models.split(","), args.metrics.split(",")
        for m in models:               # build the verified DBs once, before the workers
            for metric in metrics:
                verified_db(load_model(m), metric, progress=False)
        jobs = [(m, t, metric, args.hours, str(out)) for m in models
                for t in args.traces.split(",") for metric in metrics]
        with get_context("fork").Pool(args.jobs) as pool:
            for msg in pool.imap_unordered(run_one, jobs):
                print(msg, flush=True)
    print(table(out))


if __name__ == "__main__":
    main()
