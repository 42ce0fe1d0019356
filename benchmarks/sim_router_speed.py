"""The cluster simulator's prefill router and Erlang C grids: the shipped code against the
code it replaced, in one process, on the same replay - the same answers, the time ratio.

* ``route``: one cluster simulation (default: Base, Llama3-70B, 5 minutes of the Azure coding
  day from 12:00 at 64x its load - ~90 pipelined prefill vPods, the grid's slowest row) run
  twice: with ``orchestrator.cluster.fleet.soonest`` (vPods asked in the order of a bound on
  their wait) and with the rule it replaced, every vPod's (wait, work, outstanding) compared
  at every arrival. Prints each run's seconds, the ratio, and whether both runs' tokens/J and
  SLO rates are identical (they must be: the same vPod is picked at every arrival).
* ``erlang``: ``orchestrator.pricing._erlang_c_grid`` (closed form at every server count)
  against Erlang B's recursion up to 32 servers (the rule before), on grids of the shape the
  load-aware planner asks (8 counts x 24 loads); the largest difference and the time ratio.

    python benchmarks/sim_router_speed.py [--policy base] [--model llama3-70b] [--scale 64]
        [--hours 0.0833] [--start 12:00] [--skip-route] [--skip-erlang]

~1.5 min with the defaults on a 2-core machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse import load_model  # noqa: E402
from dse.catalog import default_catalog  # noqa: E402
from dse.errors import NeuScaleError  # noqa: E402
from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
import orchestrator.cluster.simulator as simulator  # noqa: E402
from orchestrator.cluster.fleet import prefill_key  # noqa: E402
from orchestrator.pricing import ChipModelPricer, _erlang_c_grid  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from rows import replicate  # noqa: E402
from sim.traces import load_trace  # noqa: E402
from sim.verified import verified_db  # noqa: E402


def ask_every_vpod(vpods, at_s):
    """The rule before: every vPod's key at every arrival."""
    return min(vpods, key=lambda v: prefill_key(v, at_s))


def route(args) -> None:
    arch, cat = load_model(args.model), default_catalog()
    db = verified_db(arch, args.metric, progress=False)
    tr = load_trace("azure-code", hours=args.hours, start=args.start)
    arr, inp, out = (np.asarray(tr.arrival_s), np.asarray(tr.input_tokens),
                     np.asarray(tr.output_tokens))
    if args.scale > 1:
        arr, inp, out = replicate(arr, inp, out, args.scale, args.hours * 3600.0)
    print(f"route: simulating {len(arr):,} requests twice (before, shipped) ...", flush=True)
    cfg = ClusterConfig()
    pricer = ChipModelPricer(arch, cat, db.stack)
    shipped = simulator.soonest
    got = {}
    for name, fn in (("every vPod asked (before)", ask_every_vpod), ("soonest (shipped)", shipped)):
        simulator.soonest = fn
        try:
            sim = ClusterSim(arch, db, make_policies(args.policy, db, cfg.policy, inp, out, None,
                                                     cat, pricer), cfg, cat)
            t = time.perf_counter()
            res = sim.run(arr, inp, out).to_json()
            got[name] = (time.perf_counter() - t, res)
        finally:
            simulator.soonest = shipped
    (n0, (t0, r0)), (n1, (t1, r1)) = got.items()
    print(f"route: {args.policy}, {args.model}, {len(arr):,} requests "
          f"({args.hours:g} h of Azure coding from {args.start}, x{args.scale})")
    for n, (t, r) in got.items():
        print(f"  {n:28s} {t:7.1f} s   prefill tokens/J {r['prefill']['tokens_per_j']:.6g} "
              f"SLO {r['prefill']['slo_rate']:.4f}   decode SLO {r['decode']['slo_rate']:.4f}")
    same = all(r0[ph][k] == r1[ph][k] for ph in ("prefill", "decode")
               for k in ("tokens_per_j", "tokens_per_usd", "slo_rate"))
    print(f"  shipped / before = {t1 / t0:.2f} (x{t0 / t1:.2f} faster); "
          f"identical results: {'yes' if same else 'NO'}")


def _recursion(servers, a):
    """Erlang C by Erlang B's recursion (the rule for grids up to 32 servers before)."""
    uniq, row = np.unique(np.asarray(servers, dtype=np.int64), return_inverse=True)
    a = np.asarray(a, dtype=np.float64)
    s = uniq.astype(np.float64)[:, None]
    b_at = np.empty((len(uniq), len(a)))
    b = np.ones_like(a)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for k in range(1, int(uniq[-1]) + 1):
            b = a * b / (k + a * b)
            j = np.searchsorted(uniq, k)
            if j < len(uniq) and uniq[j] == k:
                b_at[j] = b
        c = s * b_at / (s - a * (1.0 - b_at))
    return np.where(a < s, np.clip(np.where(a > 0, c, 0.0), 0.0, 1.0), 1.0)[row]


def erlang(reps: int = 3000) -> None:
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(reps):
        lo = int(rng.integers(1, 25))
        n = np.arange(lo, lo + 8)
        cases.append((n, np.sort(rng.uniform(0, lo + 8, 24))))
    worst = max(float(np.max(np.abs(_erlang_c_grid(n, a) - _recursion(n, a))))
                for n, a in cases)
    times = {}
    for name, fn in (("recursion", _recursion), ("closed form", _erlang_c_grid)):
        t = time.perf_counter()
        for n, a in cases:
            fn(n, a)
        times[name] = (time.perf_counter() - t) / reps
    print(f"erlang: {reps} grids of 8 server counts (1-32) x 24 loads; largest difference "
          f"{worst:.1e}")
    for name, t in times.items():
        print(f"  {name:12s} {t * 1e6:6.1f} us a grid")
    print(f"  closed form / recursion = {times['closed form'] / times['recursion']:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="base", help="default: base")
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--metric", default="energy", choices=("energy", "cost"))
    ap.add_argument("--scale", type=int, default=64, help="copies of the window's requests")
    ap.add_argument("--hours", type=float, default=5 / 60)
    ap.add_argument("--start", default="12:00")
    ap.add_argument("--skip-route", action="store_true")
    ap.add_argument("--skip-erlang", action="store_true")
    args = ap.parse_args(argv)
    if args.scale < 1 or not 0 < args.hours <= 24:
        print("error: --scale must be >= 1 and --hours in (0, 24] (the trace is one day)",
              file=sys.stderr)
        return 2
    try:
        if not args.skip_erlang:
            erlang()
        if not args.skip_route:
            route(args)
    except (NeuScaleError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
