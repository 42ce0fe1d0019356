"""What one long prompt costs the Ideal-at-load oracle in an epoch of light prefill load.

Ideal-at-load (``orchestrator.cluster.accounting._IdealGrid``) serves each group of
consecutive buckets on the cheapest Pareto point, of any bucket's front, that meets every
bucket's SLO. A light load of short prompts (OpenThoughts-like: 27 prompts/min of ~246 tokens)
fits one small vPod; one prompt of a few thousand tokens in the same 5-minute epoch should cost
little more when that vPod also meets the long prompt's SLO. Until 2026-12-07 the oracle took
only the points of a group's *longest* bucket and paid twice for such an epoch (DeepSeek-V3:
2,027 W -> 4,061 W with one 4,096-token prompt), which a running policy - keeping its
allocation when a longer bucket joins - did not; this prints the oracle's average power (or
$/h) for the short load alone and with one prompt of each length added, on the model's
verified database.

    python benchmarks/ial_long_prompt.py                          # deepseek-v3, energy
    python benchmarks/ial_long_prompt.py --model llama3-70b --metric cost
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--metric", choices=["energy", "cost"], default="energy")
    ap.add_argument("--short-tokens-per-s", type=float, default=110.0,
                    help="the short prompts' token rate (OpenThoughts-like: 27/min x 246)")
    ap.add_argument("--short-len", type=int, default=256)
    ap.add_argument("--long", default="1024,2048,4096,8192,12288",
                    help="lengths of the one long prompt added to the epoch")
    args = ap.parse_args()
    try:
        longs = [int(x) for x in args.long.split(",")]
        if args.short_tokens_per_s <= 0 or args.short_len < 1 or min(longs) < 1:
            raise ValueError("rates and lengths must be positive")
        from dse.catalog import default_catalog
        from dse.models import load_model
        from orchestrator.cluster.accounting import _IdealGrid
        from orchestrator.pricing import ChipModelPricer
        from sim.verified import verified_db
        arch, cat = load_model(args.model), default_catalog()
        db = verified_db(arch, args.metric, 5.0, None, cat, progress=False, stack="vllm-tpu")
    except ValueError as e:          # NeuScaleError and bad numbers: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    grid = _IdealGrid(db, ChipModelPricer(arch, cat, db.stack), "prefill", args.metric, None)
    edges = np.asarray(db.edges)
    epoch_s = 300.0
    i = 1 if args.metric == "cost" else 0
    unit, scale = ("USD/h", 3600.0) if args.metric == "cost" else ("W", 1.0)

    def spend(rates: np.ndarray) -> float:
        got = grid.solve(rates)
        return scale * sum(rates[b] * got[b][i] for b in got)

    base = np.zeros(len(edges))
    base[min(np.searchsorted(edges, args.short_len), len(edges) - 1)] = args.short_tokens_per_s
    ref = spend(base)
    print(f"{args.model} prefill, {args.metric}: short load alone {ref:,.1f} {unit}")
    for n in longs:
        if n > edges[-1]:
            print(f"  {n}: beyond the longest bucket ({edges[-1]}), skipped")
            continue
        r = base.copy()
        r[np.searchsorted(edges, n)] += n / epoch_s
        v = spend(r)
        print(f"  plus one {n:,}-token prompt in the epoch: {v:,.1f} {unit} ({v / ref:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
