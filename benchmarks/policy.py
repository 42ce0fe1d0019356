"""Time of one autoscaling decision (paper Table 3: ~100 ms; our target <= 10 ms for 100 groups).

Every bucket of both phases carries traffic, so the prefill and decode autoscalers each plan
one group per distinct best fit (the DB's 48 buckets bound this; with coalescing off every
bucket stays its own group). The baseline is a plain numpy max over the same rate samples,
measured in the same run.

    python benchmarks/policy.py [--db bestfit-llama3-70b-energy.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse import BuildOptions, BestFitDB, build  # noqa: E402
from orchestrator.policy import Observation, Policy, PolicyConfig, VPodRecord  # noqa: E402


def vpod(vid: str, group: str, e) -> VPodRecord:
    return VPodRecord(vid, group, e.chip, e.topology, e.num_chips,
                throughput_tok_per_s=e.throughput_tok_per_s, max_batch=e.max_batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", help="best-fit DB (default: build llama3-70b, energy)")
    args = ap.parse_args()
    db = BestFitDB.load(args.db) if args.db else build("llama3-70b", BuildOptions(progress=False))
    rng = np.random.default_rng(0)
    rates = {i: rng.uniform(1e3, 1e5, 180) for i in range(len(db.edges))}
    for coalescing in (False, True):
        groups = 0
        times = []
        for phase in ("prefill", "decode"):
            pol = Policy(db, phase, PolicyConfig(coalescing=coalescing))
            first = pol.plan(Observation(0.0, rates))
            inv = [vpod(f"{g}#{k}", g, s.entry) for g, s in first.groups.items()
                   for k in range(first.target.get(g, 0))]
            obs = Observation(300.0, rates, inv, {}, {"v5p": 4096, "v6e": 1024})
            groups += len(first.target)
            for _ in range(20):
                t = time.perf_counter()
                pol.plan(obs, first.state)
                times.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(200):
            max(float(np.max(r)) for r in rates.values())
        base = (time.perf_counter() - t) / 200
        med = statistics.median(times)
        print(f"coalescing={coalescing!s:5}: {groups} groups (both phases), median plan "
              f"{med * 1e3:.2f} ms per phase, baseline max-over-samples {base * 1e3:.3f} ms "
              f"(ratio {med / base:.0f}x)")
    # 100 groups in one plan: every decode bucket its own group (coalescing off) plus groups
    # that only own vPods (e.g. left from an earlier length mix), which the plan evicts
    pol = Policy(db, "decode", PolicyConfig(coalescing=False))
    first = pol.plan(Observation(0.0, rates))
    inv = [vpod(f"{g}#0", g, s.entry) for g, s in first.groups.items()]
    e = next(iter(first.groups.values())).entry
    extra = 100 - len(first.groups)
    inv += [vpod(f"old{k}#0", f"old{k}", e) for k in range(extra)]
    obs = Observation(300.0, rates, inv, {}, {})
    times = []
    for _ in range(20):
        t = time.perf_counter()
        plan = pol.plan(obs, first.state)
        times.append(time.perf_counter() - t)
    n = len(first.groups) + extra
    print(f"{n} groups in one plan ({len(first.groups)} with traffic, {extra} evicted): median "
          f"{statistics.median(times) * 1e3:.2f} ms ({len(plan.actions)} actions)")
    load_aware(db, rates)


def load_aware(db, rates) -> None:
    """The load-aware policy (`neuscale`): every bucket with traffic, so its dynamic
    programme prices every Pareto point of every bucket for every split. The first plan prices
    on the chip model (cold memo); later plans at a new load reuse the prices."""
    from dse.catalog import default_catalog
    from dse.models import ModelArch
    from orchestrator.loadaware import LoadAwarePolicy
    from orchestrator.pricing import ChipModelPricer
    pricer = ChipModelPricer(ModelArch(**db.meta["model_arch"]), default_catalog(), db.stack)
    rng = np.random.default_rng(1)
    for phase in ("prefill", "decode"):
        pol = LoadAwarePolicy(db, phase, PolicyConfig(), pricer=pricer)
        t = time.perf_counter()
        first = pol.plan(Observation(0.0, rates))
        cold = time.perf_counter() - t
        times = []
        state = first.state
        for k in range(10):
            scaled = {i: r * rng.uniform(0.5, 2.0) for i, r in rates.items()}
            t = time.perf_counter()
            plan = pol.plan(Observation(300.0 * (k + 1), scaled), state)
            times.append(time.perf_counter() - t)
            state = plan.state
        print(f"load-aware {phase}: {len(db.edges)} buckets with traffic, {len(first.target)} "
              f"groups chosen; first plan {cold * 1e3:.0f} ms (prices on the chip model), "
              f"then median {statistics.median(times) * 1e3:.1f} ms per plan")
        erlang_baseline(pol, first.state, rates)


def erlang_baseline(pol, state, rates) -> None:
    """The same plans with Erlang C by its n-step recursion at every pool size (the rule
    before; ``pricing._RECURSE_UP_TO``) against the closed form above 32 servers, in turn."""
    import orchestrator.pricing as pricing
    loads = [{i: r * f for i, r in rates.items()} for f in (0.5, 1.0, 2.0, 4.0)]
    saved = pricing._RECURSE_UP_TO
    took = {}
    try:
        for name, limit in (("closed form", saved), ("recursion", 10 ** 9)) * 2:
            pricing._RECURSE_UP_TO = limit
            t = time.perf_counter()
            for k, obs in enumerate(loads):
                pol.plan(Observation(300.0 * (k + 20), obs), state)
            took[name] = min(took.get(name, math.inf), time.perf_counter() - t)
    finally:
        pricing._RECURSE_UP_TO = saved
    print(f"  Erlang C: {took['closed form'] * 1e3 / len(loads):.1f} ms per plan in closed form "
          f"above {saved} servers, {took['recursion'] * 1e3 / len(loads):.1f} ms by recursion "
          f"(ratio {took['recursion'] / took['closed form']:.2f}x)")


if __name__ == "__main__":
    main()
