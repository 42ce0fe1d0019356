"""How often an allocation's full batch meets a longer bucket's SLO on paper but does not fit
in its KV cache there - the case ``orchestrator.pricing.ChipModelPricer`` now prices at the
batch the cache holds (``ChipModel.batch_at``) instead of the batch the point was built for.

For every verified Pareto point of every bucket (all chips of the model's verified database)
and its own bucket or each of the ``--above`` buckets above it: the pairs where the chip
model's latency at the point's full batch meets that bucket's SLO, and of those the ones whose
batch the KV cache cannot hold at that length.

    python benchmarks/kv_fit.py                                   # all four presets
    python benchmarks/kv_fit.py --models llama3-70b --phases decode
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama3-8b,llama3-70b,llama3.1-405b,deepseek-v3")
    ap.add_argument("--phases", default="prefill,decode")
    ap.add_argument("--metric", choices=["energy", "cost"], default="energy")
    ap.add_argument("--above", type=int, default=11, help="longer buckets checked per point")
    args = ap.parse_args()
    phases = args.phases.split(",")
    if any(p not in ("prefill", "decode") for p in phases) or args.above < 0:
        print("error: --phases takes prefill,decode and --above must be >= 0", file=sys.stderr)
        return 2
    try:
        from dse.catalog import default_catalog
        from dse.models import load_model
        from sim.chip import ChipModel
        from sim.verified import verified_db
        cat = default_catalog()
        dbs = [(m, load_model(m)) for m in args.models.split(",")]
        dbs = [(m, a, verified_db(a, args.metric, 5.0, None, cat, progress=False,
                                  stack="vllm-tpu")) for m, a in dbs]
    except ValueError as e:          # NeuScaleError: an unknown model, a bad database
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("model          phase    pairs meeting the SLO at full batch   of which the batch does not fit")
    for model, arch, db in dbs:
        models: dict = {}
        for ph in phases:
            slo = db.meta["slo_s"][ph]
            meets = spill = 0
            for j, e in enumerate(db.edges):
                for chip in db.chips:
                    for p in db.pareto_for(ph, e, chip):
                        if p.get("cm_meets_slo") is False:
                            continue
                        key = (chip, p["topology"], p["tp"], p["pp"], p["ep"], p.get("attn", "dp"))
                        cm = models.get(key)
                        if cm is None:
                            cm = models[key] = ChipModel.of(arch, cat, *key[:5], stack=db.stack,
                                                            attn=key[5])
                        for i in range(j, min(j + args.above + 1, len(db.edges))):
                            if cm.step(ph, p["batch"], db.edges[i]).latency_s <= slo[i]:
                                meets += 1
                                spill += not cm.holds(p["batch"], db.edges[i])
            print(f"{model:14s} {ph:8s} {meets:>12,d} {spill:>34,d} ({spill / max(meets, 1):.1%})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
