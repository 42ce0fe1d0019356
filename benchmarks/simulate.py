"""Simulated requests per wall-second of the cluster simulator (issue target: the 24-h,
2.48 M-request Azure day for deepseek-v3 in <= 120 s, i.e. ~21,000 req/s).

Baseline in the same run: routing every request through the routing table alone (the floor of
any per-request work in Python).

    python benchmarks/simulate.py [--model llama3-8b] [--hours 0.25] [--start 12:00]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse import BuildOptions, build, load_model  # noqa: E402
from sim.cluster import ClusterConfig, ClusterSim, make_policies  # noqa: E402
from sim.traces import load_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--trace", default="azure-code")
    ap.add_argument("--hours", type=float, default=0.25)
    ap.add_argument("--start", default="12:00")
    args = ap.parse_args()
    arch = load_model(args.model)
    db = build(arch, BuildOptions(progress=False))
    # trace loading: the full day, parsed, against reading and decompressing its bytes alone
    import gzip

    from sim.traces import clear_cache, data_dir
    day = data_dir() / "azure2024" / "azure2024_code_synth_2024-05-10_scale1.csv.gz"
    t = time.perf_counter()
    gzip.decompress(day.read_bytes())
    raw_s = time.perf_counter() - t
    clear_cache()
    t = time.perf_counter()
    full = load_trace("azure-code")
    load_s = time.perf_counter() - t
    print(f"azure-code day: {len(full):,} requests parsed in {load_s:.2f} s; read+gunzip alone "
          f"{raw_s:.2f} s (ratio {load_s / raw_s:.1f}x)")
    tr = load_trace(args.trace, start=args.start, hours=args.hours)
    arr, inp, out = (np.asarray(tr.arrival_s), np.asarray(tr.input_tokens),
                     np.asarray(tr.output_tokens))
    cfg = ClusterConfig()
    sim = ClusterSim(arch, db, make_policies("neuscale", db, cfg.policy, inp, out), cfg)
    t = time.perf_counter()
    sim.run(arr, inp, out)
    wall = time.perf_counter() - t
    from router.routing import RoutingTable
    table = RoutingTable.build({i: i for i in range(len(db.edges))}, db.edges)
    t = time.perf_counter()
    for x in inp.tolist():
        table.group_for_length(x)
    base = time.perf_counter() - t
    n = len(tr)
    print(f"{args.model} {args.trace} {args.hours:g} h from {args.start}: {n:,} requests, "
          f"{len(sim.vpods)} vPods, {len(sim._tables)} step-cost tables")
    print(f"  simulator {n / wall:,.0f} req/s ({wall:.1f} s); routing-only baseline "
          f"{n / base:,.0f} req/s; simulator / baseline = {base / wall:.4f}")


if __name__ == "__main__":
    main()
