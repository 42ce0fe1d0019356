"""Simulated requests per wall-second of the cluster simulator (issue target: the 24-h,
2.48 M-request Azure coding day for deepseek-v3, prefill and decode, policy neuscale, in
<= 120 s with <= 4 GiB; the verified best-fit DB and the step-cost tables already built).

Baseline in the same run: routing every request through the routing table alone (the floor of
any per-request work in Python).

    python benchmarks/simulate.py                                  # 15 min of the day, llama3-8b
    python benchmarks/simulate.py --model deepseek-v3 --hours 24 --start 00:00
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse import load_model  # noqa: E402
from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from sim.verified import verified_db  # noqa: E402
from sim.traces import load_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--trace", default="azure-code")
    ap.add_argument("--hours", type=float, default=0.25)
    ap.add_argument("--start", default="12:00")
    ap.add_argument("--policy", default="neuscale")
    ap.add_argument("--skip-load", action="store_true", help="skip timing the full-day parse")
    args = ap.parse_args()
    arch = load_model(args.model)
    db = verified_db(arch, progress=False)
    if not args.skip_load:
        # trace loading: the full day, parsed, against reading and decompressing its bytes
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
        print(f"azure-code day: {len(full):,} requests parsed in {load_s:.2f} s; read+gunzip "
              f"alone {raw_s:.2f} s (ratio {load_s / raw_s:.1f}x)")
    tr = load_trace(args.trace, start=args.start, hours=args.hours)
    arr, inp, out = (np.asarray(tr.arrival_s), np.asarray(tr.input_tokens),
                     np.asarray(tr.output_tokens))
    cfg = ClusterConfig()
    # warm the step-cost tables of the allocations the run will use (cached on disk after
    # the first run: the target assumes them built, like the DB)
    sim = ClusterSim(arch, db, make_policies(args.policy, db, cfg.policy, inp, out), cfg)
    t = time.perf_counter()
    rep = sim.run(arr, inp, out).reports
    wall = time.perf_counter() - t
    from router.routing import RoutingTable
    table = RoutingTable.build({i: i for i in range(len(db.edges))}, db.edges)
    t = time.perf_counter()
    for x in inp.tolist():
        table.group_for_length(x)
    base = time.perf_counter() - t
    n = len(tr)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.model} {args.trace} {args.hours:g} h from {args.start}, {args.policy}: "
          f"{n:,} requests, {len(sim.fleet.vpods)} vPods, {len(sim.tables)} step-cost tables")
    print(f"  simulator {n / wall:,.0f} req/s ({wall:.1f} s, peak RSS {rss_mib:,.0f} MiB); "
          f"routing-only baseline {n / base:,.0f} req/s; simulator / baseline = "
          f"{base / wall:.4f}")
    for ph, r in rep.items():
        j = r.to_json()
        print(f"  {ph:7} tokens/J {j['tokens_per_j']:.4g}  SLO {j['slo_rate']:.1%}  "
              f"migrations {j['migrations']}")


if __name__ == "__main__":
    main()
