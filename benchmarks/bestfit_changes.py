"""What a modelling switch changes in the best-fit database: builds the DB twice in this run,
with and without the switch, and prints how many feasible best fits move (per phase and chip)
and the geometric-mean efficiency ratio of the best fits, switch / baseline.

    python benchmarks/bestfit_changes.py --model llama3-70b --metric energy --switch stack
    python benchmarks/bestfit_changes.py --model llama3-70b --switch power
    python benchmarks/bestfit_changes.py --model deepseek-v3 --switch layouts
    python benchmarks/bestfit_changes.py --model deepseek-v3 --switch hot-expert

Switches: ``stack`` - the default serving-stack profile (vllm-tpu) against the bare chip model
(``none``); ``power`` - the measured maximum chip power (v4's 192 W) against none at all;
``layouts`` - the MoE layouts vllm-tpu can launch (``tp``, ``hybrid``) against what was
enumerated before the hybrid layout (``dp`` with TP inside expert groups, and ``tp``);
``hot-expert`` - the roofline pricing the chip that hosts the hottest expert (as the chip
model does) against the mean expert load it used before (patched in for the baseline build).
(The collective overlap and the attention-TP layout are code, not switches: their counts in
the README come from builds before and after their commits.)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections import Counter, defaultdict


def build(model: str, metric: str, stack, power_cap: bool):
    from dse.builder import BuildOptions, build as dse_build
    from dse.catalog import BUILTIN_CHIPS, Catalog
    chips = BUILTIN_CHIPS if power_cap else tuple(
        dataclasses.replace(c, measured_max_power_w=None) for c in BUILTIN_CHIPS)
    return dse_build(model, BuildOptions(workers=1, progress=False, metric=metric, stack=stack),
                     catalog=Catalog(chips))


def compare(base, other) -> tuple[int, int, Counter, dict]:
    moved, n, where, ratios = 0, 0, Counter(), defaultdict(list)
    for e in other.entries:
        b = base.entry_at(e.phase, base.bucket_index(e.seq_len), e.chip)
        if not (e.feasible and b is not None and b.feasible):
            continue
        n += 1
        key = (e.topology, e.tp, e.pp, e.ep, e.attn, e.max_batch)
        if key != (b.topology, b.tp, b.pp, b.ep, b.attn, b.max_batch):
            moved += 1
            where[(e.phase, e.chip)] += 1
        ratios[(e.phase, e.chip)].append(e.efficiency / b.efficiency)
    return moved, n, where, {k: math.exp(sum(map(math.log, v)) / len(v))
                             for k, v in sorted(ratios.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--metric", choices=["energy", "cost"], default="energy")
    ap.add_argument("--switch", choices=["stack", "power", "layouts", "hot-expert"],
                    default="stack")
    args = ap.parse_args()
    try:
        if args.switch == "stack":
            base = build(args.model, args.metric, "none", True)
            other = build(args.model, args.metric, "vllm-tpu", True)
        elif args.switch == "hot-expert":
            import dse.costmodel as cm
            shipped = cm.busiest_expert_tokens
            cm.busiest_expert_tokens = lambda experts, mean, stage: experts * mean
            try:
                base = build(args.model, args.metric, "vllm-tpu", True)
            finally:
                cm.busiest_expert_tokens = shipped
            other = build(args.model, args.metric, "vllm-tpu", True)
        elif args.switch == "layouts":
            from dse.stacks import get_stack
            old = dataclasses.replace(get_stack("vllm-tpu"), moe_layouts=("dp", "tp"))
            base = build(args.model, args.metric, old, True)
            other = build(args.model, args.metric, "vllm-tpu", True)
        else:
            base = build(args.model, args.metric, "vllm-tpu", False)
            other = build(args.model, args.metric, "vllm-tpu", True)
    except ValueError as e:          # NeuScaleError: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    moved, n, where, ratios = compare(base, other)
    print(f"{args.model} {args.metric}, switch {args.switch}: {moved} of {n} feasible best fits "
          f"move; by phase/chip: {dict(where)}")
    print("best-fit efficiency, switch / baseline (geometric mean): "
          + ", ".join(f"{ph}/{c} {r:.3f}" for (ph, c), r in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
