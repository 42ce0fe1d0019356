"""How much of a prefill group's TTFT SLO its routing decides, at high load and thin slack.

N batch-1 prefill vPods of one allocation (default: Llama3-70B's v6e-8 TP 2 PP 4, the Azure
day's prefill allocation), Poisson arrivals at utilisation ``--rho`` of their throughput,
prompt lengths drawn from the Azure coding window (12:00, 15 min), the simulated engines (a PP
vPod's virtual engines, ``sim.vpod``). Two routers, same arrivals, same engines:

* ``slice`` - the cluster simulator's before this was fixed: a prompt goes to the vPod with
  the least outstanding prompt tokens, a count that learns of finished prompts only at each
  10-s slice's end, and to that vPod's virtual engine with the least work given to it
  (``sim.vpod.VPodEngines.choose`` without an arrival time);
* ``exact`` - every engine advanced to the arrival, the prompt to the virtual engine (of any
  vPod) that can start it first: a central queue, what Erlang C assumes and what a gateway
  that knows each vPod's in-flight work at every arrival comes close to;
* ``shipped`` - the cluster simulator's now (``ClusterSim._submit``): the vPod whose engines
  has an engine free soonest at the arrival, then the least projected work
  (``VPodEngines.backlog_s``), and its virtual engine that can start the prompt first.

Every router gives a batch-1 pipelined vPod one prompt per stage time at its first stage
(``sim.vpod.VPodEngines.submit``): on the Azure window's mix of prompt lengths a TP 2 PP 4 pool
then saturates near 78 % of its nominal throughput (each virtual engine holds a prompt for its
whole pass), so ``--rho 0.86`` (the default, where the routing fix was measured on ungated
engines) is past it for every router; ``--rho 0.7`` shows the routers apart.

Prints the share of prompts that met their bucket's TTFT SLO under each, and the median slack
(SLO minus latency, in the vPod's cycles). ~5 s with the defaults::

    python benchmarks/prefill_routing.py [--vpods 23] [--rho 0.86] [--prompts 20000]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse.catalog import default_catalog  # noqa: E402
from dse.errors import NeuScaleError  # noqa: E402
from orchestrator.pricing import Alloc, ChipModelPricer  # noqa: E402
from rows import load_row  # noqa: E402
from sim.vpod import TableCache, vpod_engines  # noqa: E402

SLICE_S = 10.0      # the cluster simulator's slice (PolicyConfig.sample_s)


def run(router: str, vpods: int, rho: float, prompts: int, chip: str, topology: str,
        num_chips: int, tp: int, pp: int, seed: int = 0) -> tuple[float, float]:
    row = load_row("llama3-70b:azure-code:energy:prefill", "12:00", 0.25, 1)
    db, cat = row.db, default_catalog()
    pricer = ChipModelPricer(row.arch, cat, db.stack)
    table = TableCache(row.arch, cat, stack=db.stack)((chip, topology, tp, pp, 1, "dp"))
    alloc = Alloc(chip, topology, num_chips, tp, pp, 1, 1)
    edges = np.asarray(db.edges)
    slo = np.asarray(db.meta["slo_s"]["prefill"])
    pool = np.asarray(row.input_tokens)
    pool = pool[pool <= 8192]                       # one engine step each (max batched tokens)
    rng = np.random.default_rng(seed)
    lens = rng.choice(pool, prompts)
    cost = {int(n): pricer.cost(alloc, "prefill", int(n)) for n in np.unique(lens)}
    work_s = np.array([n / cost[int(n)].throughput_tok_per_s for n in lens])
    arr = np.cumsum(rng.exponential(work_s.mean() / (rho * vpods), prompts))
    vps = [vpod_engines(table, "prefill", 1, pp, 8192, 0.0) for _ in range(vpods)]
    finish: dict[int, float] = {}
    outstanding = [0.0] * vpods
    slice_end = SLICE_S
    for k in range(prompts):
        at, n = float(arr[k]), int(lens[k])
        if router == "exact":
            for v in vps:
                for q in v.advance_to(at):
                    finish[q.req_id] = q.finish_s
            # an engine's clock may run past `at` (the step it is in); a waiting prompt
            # means it is busier still; a pipelined vPod's first stage admits one prompt per
            # stage time (sim.vpod.VPodEngines.submit_to)
            _, j, e = min((max(eng.now_s, at, v.stage_free_s) + 1e3 * eng.num_waiting, i, x)
                          for i, v in enumerate(vps) for x, eng in enumerate(v.engines))
            vps[j].submit_to(e, k, at, n, 1)
            continue
        if router == "shipped":
            j = min(range(vpods), key=lambda i: (*vps[i].backlog_s(at), outstanding[i]))
            outstanding[j] += n
            vps[j].submit(k, at, n, 1)
            continue
        while at >= slice_end:                      # the simulator learns of finishes here
            for i, v in enumerate(vps):
                for q in v.advance_to(slice_end):
                    finish[q.req_id] = q.finish_s
                    outstanding[i] -= int(lens[q.req_id])
            slice_end += SLICE_S
        j = min(range(vpods), key=lambda i: outstanding[i])
        outstanding[j] += n
        v = vps[j]
        e = v.choose(n, 1)                          # by the work given (no arrival time)
        v.submit_to(e, k, at, n, 1)
    for v in vps:
        for q in v.advance_to(1e12):
            finish[q.req_id] = q.finish_s
    ttft = np.array([finish[k] - arr[k] for k in range(prompts)])
    s = slo[np.searchsorted(edges, lens)]
    lat = np.array([cost[int(n)].latency_s for n in lens])
    cycles = (s - lat) / (lat / np.array([cost[int(n)].in_flight for n in lens]))
    return float(np.mean(ttft <= s)), float(np.median(cycles))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vpods", type=int, default=23)
    ap.add_argument("--rho", type=float, default=0.86, help="utilisation of the vPods (0-1)")
    ap.add_argument("--prompts", type=int, default=20000)
    ap.add_argument("--alloc", default="v6e:4x2:8:2:4",
                    help="chip:topology:chips:tp:pp of the batch-1 prefill vPods")
    args = ap.parse_args()
    if args.vpods < 1 or not 0 < args.rho < 1 or args.prompts < 100:
        ap.error("need --vpods >= 1, 0 < --rho < 1, --prompts >= 100")
    try:
        chip, topo, chips, tp, pp = args.alloc.split(":")
        chips, tp, pp = int(chips), int(tp), int(pp)
    except ValueError:
        ap.error(f"--alloc: {args.alloc!r} is not chip:topology:chips:tp:pp")
    for router in ("slice", "exact", "shipped"):
        try:
            met, cyc = run(router, args.vpods, args.rho, args.prompts, chip, topo, chips, tp, pp)
        except NeuScaleError as e:              # an unknown chip, an invalid TP/PP split
            sys.exit(f"error: --alloc {args.alloc}: {e}")
        print(f"{router:6} router: {args.vpods} vPods at {args.rho:.0%} busy, "
              f"TTFT SLO met {met:.1%} (median slack {cyc:.2f} cycles)", flush=True)


if __name__ == "__main__":
    main()
