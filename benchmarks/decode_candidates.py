"""Which Pareto points the load-aware policy may run a group on (``neuscale``;
``LoadAwarePolicy._candidates`` and ``_front``), measured: each row replayed with the shipped
candidate set and with the variants the README weighs against it, in one run.

Variants (class attributes of :class:`orchestrator.loadaware.LoadAwarePolicy`, set in the
worker for that replay only):

* ``shipped`` - as the tree ships it;
* ``own-front`` - a group's candidates only its longest bucket's own front (the tree before
  a2ba130);
* ``held:N`` - decode: another front's point only where its KV cache holds at least N of the
  segment's longest sequences (``OTHER_FRONT_HELD``; shipped 1, the rule of a2ba130 2);
* ``margin:M`` - decode: another front's point only where its TPOT is within M x the SLO of
  every bucket it would serve (``OTHER_FRONT_MARGIN``; the own front keeps the SLO itself);
* ``prefill-every-front`` - prefill: candidates from every bucket's front too
  (``OTHER_FRONT_PHASES``).

Prints per row and variant the phase's efficiency (tokens/J or tokens/$), its SLO rate, the
ratio to ``shipped`` and the vPod-hours the phase ran.

    python benchmarks/decode_candidates.py --jobs 2                    # the README's rows, 2 h from 12:00
    python benchmarks/decode_candidates.py --rows llama3-70b:azure-code:energy:decode \\
        --copies 64 --hours 0.25 --variants shipped,own-front,margin:0.9   # the sweep's 64x point
"""

from __future__ import annotations

import argparse
import sys
import time
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rows import check_rows, load_row  # noqa: E402

DECODE_ROWS = ("llama3-8b:lveval:energy:decode", "llama3-70b:lveval:cost:decode",
               "llama3-70b:azure-code:energy:decode", "deepseek-v3:azure-code:cost:decode")
PREFILL_ROWS = ("llama3-70b:lveval:cost:prefill", "deepseek-v3:lveval:energy:prefill",
                "deepseek-v3:azure-code:cost:prefill", "llama3-8b:azure-code:cost:prefill",
                "llama3.1-405b:azure-code:cost:prefill", "llama3-70b:azure-code:cost:prefill")
DECODE_VARIANTS = ("shipped", "own-front", "held:2")
PREFILL_VARIANTS = ("shipped", "prefill-every-front")


def _number(name: str, ok, what: str) -> float:
    """The number after ``name``'s colon, checked by ``ok`` (ValueError saying ``what``)."""
    try:
        x = float(name.split(":", 1)[1])
    except ValueError:
        x = float("nan")
    if not ok(x):
        raise ValueError(f"{name!r}: {what}")
    return x


def variant_attrs(name: str) -> dict:
    """The policy's class attributes a variant sets (ValueError for an unknown name)."""
    if name == "shipped":
        return {}
    if name == "own-front":
        return {"OTHER_FRONT_PHASES": ()}
    if name == "prefill-every-front":
        return {"OTHER_FRONT_PHASES": ("prefill", "decode")}
    if name.startswith("held:"):
        return {"OTHER_FRONT_HELD": _number(name, lambda k: k >= 0.0,
                                            "the count of sequences must be a number >= 0")}
    if name.startswith("margin:"):
        return {"OTHER_FRONT_MARGIN": _number(name, lambda m: 0.0 < m <= 1.0,
                                              "the margin must be a number in (0, 1]")}
    raise ValueError(f"unknown variant {name!r} (shipped, own-front, held:N, margin:M, "
                     "prefill-every-front)")


def run_one(job: tuple) -> tuple:
    row, variant, start, hours, copies = job
    from orchestrator.cluster import ClusterConfig, ClusterSim
    from orchestrator.loadaware import LoadAwarePolicy
    from orchestrator.registry import make_policies
    r = load_row(row, start, hours, copies)
    saved = {k: getattr(LoadAwarePolicy, k) for k in variant_attrs(variant)}
    for k, v in variant_attrs(variant).items():
        setattr(LoadAwarePolicy, k, v)
    t = time.perf_counter()
    try:
        cfg = ClusterConfig()
        res = ClusterSim(r.arch, r.db, make_policies("neuscale", r.db, cfg.policy,
                                                     r.input_tokens, r.output_tokens),
                         cfg).run(r.arrival_s, r.input_tokens, r.output_tokens)
    finally:
        for k, v in saved.items():
            setattr(LoadAwarePolicy, k, v)
    rep = res.reports[r.phase].to_json()
    return (row, variant, rep[r.key], rep["slo_rate"], sum(rep["vpod_hours"].values()),
            time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None,
                    help="comma-separated model:trace:metric:phase (default: the README's "
                         "four decode and six prefill rows)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated (default: shipped,own-front,held:2 on decode rows, "
                         "shipped,prefill-every-front on prefill rows)")
    ap.add_argument("--start", default="12:00")
    ap.add_argument("--hours", type=float, default=2.0)
    ap.add_argument("--copies", type=int, default=1,
                    help="replay this many copies of the window's users (the load sweep's x)")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    rows = args.rows.split(",") if args.rows else list(DECODE_ROWS + PREFILL_ROWS)
    check_rows(ap, rows, args.hours)
    if args.copies < 1 or args.jobs < 1:
        ap.error("--copies and --jobs must be whole numbers >= 1")
    jobs = []
    for row in rows:
        names = (args.variants.split(",") if args.variants else
                 DECODE_VARIANTS if row.endswith(":decode") else PREFILL_VARIANTS)
        if "shipped" not in names:
            names = ["shipped"] + names
        for v in names:
            try:
                variant_attrs(v)
            except ValueError as e:
                ap.error(str(e))
            jobs.append((row, v, args.start, args.hours, args.copies))
    from dse.errors import NeuScaleError
    x = f", {args.copies}x" if args.copies != 1 else ""
    print(f"{args.hours:g} h from {args.start}{x}\n")
    print("| row | variant | efficiency | SLO | / shipped | vPod-hours | wall s |")
    print("|---|---|---|---|---|---|---|")
    shipped: dict[str, float] = {}
    try:
        with get_context("spawn").Pool(args.jobs) as pool:
            # in job order (imap), a row's shipped replay first
            for row, v, eff, slo, vh, wall in pool.imap(run_one, jobs):
                if v == "shipped":
                    shipped[row] = eff
                base = shipped.get(row)
                rel = f"{eff / base:.3f}x" if base else "-"
                print(f"| {row} | {v} | {eff:.4g} | {slo:.1%} | {rel} | {vh:.1f} | "
                      f"{wall:.0f} |", flush=True)
    except NeuScaleError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
