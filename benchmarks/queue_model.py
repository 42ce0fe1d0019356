"""The load-aware policy's prefill queue model against the simulated engines it sizes.

N batch-1 prefill vPods of one allocation (default: Llama3-70B's v6e-8 TP 2 PP 4, the Azure
day's prefill allocation), Poisson arrivals at utilisation ``rho`` of their nominal throughput,
prompt lengths drawn from the Azure coding window (12:00, 15 min), routed as the cluster
simulator routes them (``prefill_routing.py``'s ``shipped`` router, the first stage gated).
Beside each simulated share of prompts that missed their bucket's TTFT SLO, what the policy's
model predicts for the same vPods and load (``orchestrator.pricing.mix_slack`` over the
prompts, with and without the pipeline's saturation share): the test ``servers_needed`` holds
to 5 %. ~1 min::

    python benchmarks/queue_model.py [--vpods 1,3] [--rho 0.2,0.35,0.5,0.65]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import prefill_routing  # noqa: E402
from dse.catalog import default_catalog  # noqa: E402
from orchestrator.pricing import (Alloc, ChipModelPricer, erlang_c, gated_depth,  # noqa: E402
                                  mix_slack)
from rows import load_row  # noqa: E402

CHIP, TOPOLOGY, CHIPS, TP, PP = "v6e", "4x2", 8, 2, 4


def predicted(k: int, rho: float, w, slack, eta: float) -> float:
    busy = rho * k / eta
    if busy >= k:
        return 1.0
    return erlang_c(k, busy) * float(w @ np.exp(-2.0 * (k - busy) * slack))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vpods", default="1,3")
    ap.add_argument("--rho", default="0.2,0.35,0.5,0.65")
    ap.add_argument("--prompts", type=int, default=20000)
    args = ap.parse_args()
    try:
        vpods = [int(x) for x in args.vpods.split(",")]
        rhos = [float(x) for x in args.rho.split(",")]
    except ValueError:
        ap.error("--vpods and --rho: comma-separated numbers, e.g. --vpods 1,3 --rho 0.2,0.5")
    if not vpods or min(vpods) < 1 or not rhos or not all(0 < r < 1 for r in rhos):
        ap.error("--vpods >= 1, 0 < --rho < 1")
    row = load_row("llama3-70b:azure-code:energy:prefill", "12:00", 0.25, 1)
    db = row.db
    pricer = ChipModelPricer(row.arch, default_catalog(), db.stack)
    alloc = Alloc(CHIP, TOPOLOGY, CHIPS, TP, PP, 1, 1)
    edges, slo = np.asarray(db.edges), np.asarray(db.meta["slo_s"]["prefill"])
    pool = np.asarray(row.input_tokens)
    lens = np.random.default_rng(0).choice(pool[pool <= 8192], 3000)
    cost = {int(n): pricer.cost(alloc, "prefill", int(n)) for n in np.unique(lens)}
    lat = np.array([cost[int(n)].latency_s for n in lens])
    cyc = lat / np.array([cost[int(n)].in_flight for n in lens])
    w, s, eta = mix_slack(lat, cyc, slo[np.searchsorted(edges, lens)], np.ones(len(lens)),
                          gated_depth(alloc))
    print(f"{CHIP}-{CHIPS} TP {TP} PP {PP} batch 1, Azure coding prompts: pipeline saturation "
          f"share {eta:.3f}")
    print("vPods  rho   simulated miss  model  model without the saturation share")
    for k in vpods:
        for rho in rhos:
            met, _ = prefill_routing.run("shipped", k, rho, args.prompts, CHIP, TOPOLOGY,
                                         CHIPS, TP, PP)
            print(f"{k:5d}  {rho:.2f}  {1 - met:14.4f}  {predicted(k, rho, w, s, eta):.4f}  "
                  f"{predicted(k, rho, w, s, 1.0):.4f}")


if __name__ == "__main__":
    main()
