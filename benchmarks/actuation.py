"""What the two actuation rules NeuScale adds to the paper's policy buy, in the same run:
the paper's rule (`neuscale-paper`) as shipped against (a) coalescing by the paper's rule alone (next longer group with
room, SLO not checked) and (b) routing straight to a newly planned group (break before make).

    python benchmarks/actuation.py                                   # both cases below
    python benchmarks/actuation.py --model M --trace T --hours H [--start HH:MM]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse import load_model  # noqa: E402
from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from sim.verified import verified_db  # noqa: E402
from sim.traces import load_trace  # noqa: E402

CASES = [("deepseek-v3", "azure-code", 2.0, "12:00"), ("llama3-8b", "azure-conv-2023", 0.5, None)]


def one(model: str, trace: str, hours: float, start: str | None) -> None:
    arch = load_model(model)
    db = verified_db(arch, progress=False)
    tr = load_trace(trace, hours=hours, start=start)
    arr, inp, out = (np.asarray(tr.arrival_s), np.asarray(tr.input_tokens),
                     np.asarray(tr.output_tokens))
    base = ClusterConfig()
    variants = {"shipped": base,
                "paper coalescing": replace(base, policy=replace(base.policy,
                                                                 coalesce_keep_slo=False)),
                "break before make": replace(base, make_before_break=False)}
    print(f"{model} on {trace}, {hours:g} h{' from ' + start if start else ''}: "
          f"{len(tr):,} requests")
    ref = None
    for name, cfg in variants.items():
        t = time.perf_counter()
        # the paper's rule: coalescing is one of its stages (the load-aware policy chooses its
        # groups itself and ignores coalesce_keep_slo), and the README's figures are its
        sim = ClusterSim(arch, db, make_policies("neuscale-paper", db, cfg.policy, inp, out),
                         cfg)
        rep = sim.run(arr, inp, out).to_json()
        wall = time.perf_counter() - t
        ref = ref or rep
        cells = []
        for ph in ("prefill", "decode"):
            r = rep[ph]
            ratio = r["tokens_per_j"] / ref[ph]["tokens_per_j"]
            cells.append(f"{ph} SLO {r['slo_rate']:6.1%}, tok/J x{ratio:.2f}")
        print(f"  {name:18} " + "; ".join(cells) + f"  ({wall:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--trace")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--start")
    a = ap.parse_args()
    cases = [(a.model, a.trace, a.hours, a.start)] if a.model and a.trace else CASES
    for c in cases:
        one(*c)


if __name__ == "__main__":
    main()
