"""How often a decode sequence finds no room in one vPod's KV cache at a row's load: the
Kaufman-Roberts recursion of a multi-rate loss system (the cache's blocks the capacity, each
length bucket a class whose sequences hold their bucket's length for their stay), per class and
weighted by load, for N vPods sharing the window's requests of a length range evenly.

It asks whether counting "how many of the segment's longest sequences the cache holds"
(``LoadAwarePolicy.OTHER_FRONT_HELD``) stands for a steady-state knapsack the queue model
misses (README, "Decode candidates from every front"). A loss model: a blocked sequence here
is one that would wait for another to leave; the stay is each request's output tokens x the
allocation's TPOT at its bucket on the chip model; a sequence is counted at its bucket's upper
edge (its size when its answer ends).

    python benchmarks/kv_blocking.py --row llama3-8b:lveval:energy:decode \\
        --alloc v5p:1x1x1:1:1:1:1:528 --vpods 1,2,3 --lengths 131073-1048576
    python benchmarks/kv_blocking.py --row llama3-70b:lveval:cost:decode \\
        --alloc v5p:2x2x1:4:4:1:1:528 --vpods 1,2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rows import check_rows, load_row  # noqa: E402


def kaufman_roberts(capacity: int, sizes, loads) -> np.ndarray:
    """Blocking probability of each class in a loss system of ``capacity`` units: class k
    takes ``sizes[k]`` units for its holding time, offered ``loads[k]`` Erlangs. A class
    larger than the capacity is always blocked."""
    q = np.zeros(capacity + 1)
    q[0] = 1.0
    ab = [(int(s), float(a) * int(s)) for s, a in zip(sizes, loads) if a > 0 and s <= capacity]
    for c in range(1, capacity + 1):
        q[c] = sum(w * q[c - s] for s, w in ab if s <= c) / c
        if q[c] > 1e200:                    # keep the unnormalised recursion finite
            q[:c + 1] /= 1e200
    q /= q.sum()
    at_least = np.cumsum(q[::-1])[::-1]     # P(occupancy >= c)
    return np.array([at_least[capacity - int(s) + 1] if s <= capacity else 1.0 for s in sizes])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", required=True, help="model:trace:metric:decode")
    ap.add_argument("--alloc", required=True,
                    help="chip:topology:chips:tp:pp:ep:batch, e.g. v5p:2x2x1:4:4:1:1:528")
    ap.add_argument("--vpods", default="1,2,3", help="comma-separated vPod counts")
    ap.add_argument("--lengths", default="1-1048576",
                    help="the group's total lengths (prompt + answer), A-B")
    ap.add_argument("--start", default="12:00")
    ap.add_argument("--hours", type=float, default=2.0)
    ap.add_argument("--units", type=int, default=400,
                    help="the cache's capacity in recursion units (its blocks, coarsened)")
    args = ap.parse_args()
    check_rows(ap, [args.row], args.hours, "--row")
    if not args.row.endswith(":decode"):
        ap.error("--row: a decode row (the KV cache is decode's)")
    try:
        chip, topo, *nums = args.alloc.split(":")
        n, tp, pp, ep, batch = (int(x) for x in nums)
        vpods = [int(x) for x in args.vpods.split(",")]
        lo, hi = (int(x) for x in args.lengths.split("-"))
    except ValueError:
        ap.error("--alloc chip:topology:chips:tp:pp:ep:batch, --vpods N,N,..., --lengths A-B "
                 "(whole numbers)")
    if min(vpods) < 1 or not 1 <= lo <= hi or args.units < 10:
        ap.error("--vpods >= 1, --lengths 1 <= A <= B, --units >= 10")
    from dse.catalog import default_catalog
    from dse.errors import NeuScaleError
    from orchestrator.pricing import Alloc, ChipModelPricer
    from sim.chip import ChipModel
    try:
        r = load_row(args.row, args.start, args.hours)
        cat = default_catalog()
        a = Alloc(chip, topo, n, tp, pp, ep, batch)
        cm = ChipModel.of(r.arch, cat, *a.key[:5], stack=r.db.stack, attn=a.attn)
    except (NeuScaleError, KeyError, ValueError) as e:
        sys.exit(f"error: {e}")
    pricer = ChipModelPricer(r.arch, cat, r.db.stack)
    cap = cm.kv_capacity_tokens()
    unit = max(1, -(-cap // args.units))
    tot = r.input_tokens + r.output_tokens
    sel = (tot >= lo) & (tot <= hi) & (r.output_tokens > 1)
    if not sel.any():
        sys.exit(f"error: no request of {lo}-{hi} tokens in the window")
    edges = np.asarray(r.db.edges)
    bucket = np.minimum(np.searchsorted(edges, tot[sel]), len(edges) - 1)
    span_s = args.hours * 3600.0
    sizes, loads, names = [], [], []
    for k in np.unique(bucket):
        m = bucket == k
        c = pricer.cost(a, "decode", int(edges[k]))
        stay_s = float((r.output_tokens[sel][m] * c.latency_s).mean())
        sizes.append(-(-int(edges[k]) // unit))
        loads.append(m.sum() / span_s * stay_s)
        names.append(int(edges[k]))
    loads = np.asarray(loads)
    print(f"{args.row} {args.hours:g} h from {args.start}, {args.alloc}: KV cache {cap:,} tokens "
          f"({cap / max(names):.2f} of the longest, {max(names):,}); {int(sel.sum()):,} requests "
          f"of {lo}-{hi} tokens, {loads.sum():.3f} sequences in flight")
    print("\n| vPods | in flight per vPod | longest class blocked | load-weighted blocked | "
          "classes > 1 % |")
    print("|---|---|---|---|---|")
    for nv in vpods:
        bl = kaufman_roberts(-(-cap // unit) if cap else 0, sizes, loads / nv)
        wide = ", ".join(f"{nm:,}: {x:.3f}" for nm, x in zip(names, bl) if x > 0.01)
        print(f"| {nv} | {loads.sum() / nv:.3f} | {bl[-1]:.3f} | "
              f"{float((bl * loads).sum() / loads.sum()):.4f} | {wide or '-'} |")


if __name__ == "__main__":
    main()
