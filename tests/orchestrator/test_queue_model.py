"""The prefill queue model the load-aware policy sizes groups by (:func:`orchestrator.pricing.
mix_slack`, :func:`orchestrator.pricing.servers_needed`) against an event-by-event FCFS
M/G/k queue of a mix of prompt lengths: each class its own (deterministic) service time and
its own slack (SLO minus latency)."""

from __future__ import annotations

import heapq
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))   # engine_cases

from engine_cases import affine  # noqa: E402
from orchestrator.pricing import (Alloc, _levels, erlang_c, gated_depth, rising,  # noqa: E402
                                  mix_slack, pipeline_efficiency, pipeline_throughput,
                                  servers_for_window, servers_needed, window_miss)
from sim.fastengine import DecodeEngine, PrefillEngine  # noqa: E402
from sim.vpod import VPodEngines  # noqa: E402


def fcfs_miss(k: int, rate: float, service_s, share, slack_s, n: int = 200_000,
              seed: int = 1) -> float:
    """Share of requests that wait longer than their class's slack: Poisson arrivals, one
    FCFS queue, k servers, the first 5 % of the run left out (the warm-up)."""
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1.0 / rate, n))
    cls = rng.choice(len(service_s), n, p=share)
    free = [0.0] * k
    warm = arr[-1] * 0.05
    missed = counted = 0
    for t, c in zip(arr.tolist(), cls.tolist()):
        start = max(heapq.heappop(free), t)
        heapq.heappush(free, start + service_s[c])
        if t > warm:
            counted += 1
            missed += (start - t) > slack_s[c]
    return missed / counted


def predicted(k: int, busy: float, service_s, share, slack_s) -> tuple[float, float]:
    """(the mix model's miss share, the rule before's: the tightest class's slack counted in
    its own service times)."""
    s, d, w = (np.asarray(x, dtype=np.float64) for x in (service_s, slack_s, share))
    ww, sl, _ = mix_slack(s, s, d + s, w)
    c = erlang_c(k, busy)
    return (c * float(ww @ np.exp(-2.0 * (k - busy) * sl)),
            c * math.exp(-2.0 * (k - busy) * float(np.min(d / s))))


CASES = [  # servers, utilisation, service times, shares, slacks; the rule before's error
    (8, 0.85, (0.1, 1.0), (0.8, 0.2), (0.3, 1.0), "optimistic"),    # short ones behind long
    (16, 0.9, (0.05, 0.5), (0.9, 0.1), (0.2, 0.5), "optimistic"),
    (8, 0.8, (0.1, 1.0), (0.05, 0.95), (0.05, 3.0), "pessimistic"),  # a rare tight class
]


@pytest.mark.parametrize("k,util,service,share,slack,before", CASES)
def test_the_mix_model_predicts_the_share_that_waits_past_its_slack(k, util, service, share,
                                                                    slack, before):
    mean = float(np.dot(share, service))
    busy = util * k
    got = fcfs_miss(k, busy / mean, service, share, slack)
    mix, old = predicted(k, busy, service, share, slack)
    assert 0.01 < got < 0.5                                   # a regime where it matters
    assert mix == pytest.approx(got, rel=0.25)
    if before == "optimistic":
        assert old < got / 1.5
    else:
        assert old > got * 1.5


def _arrivals(levels, dt: float, rng) -> np.ndarray:
    """Poisson arrivals whose rate is ``levels[k]`` per second in the k-th ``dt`` interval."""
    return np.concatenate([np.sort(rng.uniform(k * dt, (k + 1) * dt, rng.poisson(r * dt)))
                           for k, r in enumerate(levels)])


def _fcfs_trace(arr, cls, k: int, service_s, slack_s) -> float:
    free = [0.0] * k
    missed = 0
    for t, c in zip(arr.tolist(), cls.tolist()):
        start = max(heapq.heappop(free), t)
        heapq.heappush(free, start + service_s[c])
        missed += (start - t) > slack_s[c]
    return missed / len(arr)


@pytest.mark.parametrize("levels", [
    np.full(180, 2.0),                                  # light and steady: ~70 prompts a sample
    np.full(180, 8.0),
    np.r_[np.full(120, 6.0), np.full(60, 10.0)],        # a step up for the last 10 minutes
], ids=["light", "steady", "step"])
def test_sized_over_the_window_the_pool_meets_the_target_with_fewer_servers(levels):
    """A window's 10-s demand samples (servers' worth of work each, as the policy counts
    them) of Poisson arrivals of a mix: the fewest servers for which at most 5 % of the
    window's requests wait past their slack (each sample a steady state) meet the target on
    those very arrivals in the FCFS queue, the model is not optimistic there, and the peak
    sample - mostly noise the queue model counts already - would have sized the pool larger."""
    service, share, slack = (0.1, 1.0), (0.8, 0.2), (0.3, 1.0)
    mean, dt = float(np.dot(share, service)), 10.0
    mix = mix_slack(service, service, np.add(slack, service), share)
    rng = np.random.default_rng(0)
    arr = _arrivals(np.asarray(levels) / mean, dt, rng)
    cls = rng.choice(2, len(arr), p=share)
    demand = np.bincount(np.minimum((arr // dt).astype(int), len(levels) - 1),
                         weights=np.asarray(service)[cls], minlength=len(levels)) / dt
    n = servers_for_window(demand, mix)
    assert n < servers_needed(float(demand.max()), mix)
    got = _fcfs_trace(arr, cls, n, service, slack)
    assert got <= 0.05
    assert window_miss(n, *_levels(demand), mix) >= got
    assert _fcfs_trace(arr, cls, n - 2, service, slack) > 0.05 * 1.5   # not sized loosely
    # a constant series is one level: the peak's answer
    assert servers_for_window(np.full(30, 3.3), mix) == servers_needed(3.3, mix)
    assert servers_for_window(np.zeros(30), mix) == 0


def _future_miss(arr, cls, n: int, service_s, slack_s, from_s: float) -> float:
    """The FCFS queue of ``n`` servers over all the arrivals; the share of those from
    ``from_s`` on that wait past their slack (the backlog of the window carries over)."""
    free = [0.0] * n
    missed = seen = 0
    for t, c in zip(arr.tolist(), cls.tolist()):
        start = max(heapq.heappop(free), t)
        heapq.heappush(free, start + service_s[c])
        if t >= from_s:
            seen += 1
            missed += (start - t) > slack_s[c]
    return missed / seen


def test_a_rising_load_is_sized_for_where_it_will_be_when_the_next_plan_can_act():
    """A load rising 50 % over the window goes on rising while the pool sized now serves (an
    epoch and a start-up, 40 samples): sized for the window it misses more than 5 % of those
    requests on average; taken to the level the window's rise reaches by then, at most 5 % on
    every seed. The rise that counts is the slope less two standard errors: on steady Poisson
    loads light or heavy it is 0 and the sizing is the window's."""
    service, share, slack = (0.1, 1.0), (0.8, 0.2), (0.3, 1.0)
    mean, dt, ahead = float(np.dot(share, service)), 10.0, 40
    mix = mix_slack(service, service, np.add(slack, service), share)
    levels = np.linspace(20.0, 30.0, 180, endpoint=False)
    step = 10.0 / 180
    before, after = [], []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        arr = _arrivals(np.r_[levels, 30.0 + step * np.arange(ahead)] / mean, dt, rng)
        cls = rng.choice(2, len(arr), p=share)
        win = arr < 180 * dt
        demand = np.bincount((arr[win] // dt).astype(int),
                             weights=np.asarray(service)[cls[win]], minlength=180) / dt
        assert 0.6 * step < rising(demand) < step
        n0 = servers_for_window(demand, mix, recent=30)
        n1 = servers_for_window(demand, mix, recent=30, ahead=ahead)
        assert n1 > n0
        before.append(_future_miss(arr, cls, n0, service, slack, 180 * dt))
        after.append(_future_miss(arr, cls, n1, service, slack, 180 * dt))
    assert np.mean(before) > 0.05
    assert max(after) <= 0.05
    for level in (2.0, 30.0):
        rng = np.random.default_rng(1)
        arr = _arrivals(np.full(180, level) / mean, dt, rng)
        cls = rng.choice(2, len(arr), p=share)
        demand = np.bincount(np.minimum((arr // dt).astype(int), 179),
                             weights=np.asarray(service)[cls], minlength=180) / dt
        assert rising(demand) == 0.0
        assert servers_for_window(demand, mix, recent=30, ahead=ahead) == \
            servers_for_window(demand, mix, recent=30)


def test_one_length_is_the_rule_before():
    """One bucket: the slack is its SLO over its latency, minus 1, in cycles - as before."""
    w, s, eta = mix_slack([2.0], [0.5], [3.0], [7.0])
    assert list(w) == [1.0] and s[0] == pytest.approx((3.0 / 2.0 - 1.0) * 2.0 / 0.5)
    assert eta == 1.0                                  # no pipeline gate: nominal throughput
    for a in (0.4, 3.3, 17.0):
        assert servers_needed(a, (w, s, eta)) == servers_needed(a, float(s[0]))


def test_sized_by_the_mix_a_pool_meets_the_target():
    """The fewest servers the mix test allows miss about 5 % in the queue simulation, one
    fewer clearly more; the tightest-class rule sizes the same load too small."""
    service, share, slack = (0.1, 1.0), (0.8, 0.2), (0.3, 1.0)
    mean = float(np.dot(share, service))
    load = 20.0                                                  # servers' worth of work
    mix = mix_slack(service, service, np.add(slack, service), share)
    n = servers_needed(load, mix)
    old = servers_needed(load, min(d / x for d, x in zip(slack, service)))
    assert old < n
    rate = load / mean
    assert fcfs_miss(n, rate, service, share, slack) <= 0.05 * 1.25
    assert fcfs_miss(n - 1, rate, service, share, slack) > 0.05
    assert fcfs_miss(old, rate, service, share, slack) > 0.05 * 1.5


def test_no_requests_counts_the_buckets_alike_and_a_missed_slo_leaves_no_slack():
    w, s, _ = mix_slack([1.0, 2.0], [1.0, 2.0], [0.5, 4.0], [0.0, 0.0])
    assert list(w) == [0.5, 0.5] and s[0] == 0.0 and s[1] > 0.0


def _saturated_vpod_throughput(prompts) -> tuple[float, float]:
    """Prompts per second a PP 4 vPod's batch-1 virtual engines (``sim.vpod``, the first stage
    gated) pass when every prompt is there at t=0, and their nominal rate (4 per mean lone
    time)."""
    ve = VPodEngines([PrefillEngine(affine(1 << 16), max_batch=1) for _ in range(4)], depth=4)
    recs = [ve.submit(i, 0.0, int(n), 1) for i, n in enumerate(prompts)]
    ve.advance_to(1e9)
    lone = np.array([ve.service_s(int(n)) for n in prompts])
    return len(prompts) / max(r.first_token_s for r in recs), 4.0 / float(lone.mean())


def test_a_batch1_pipeline_passes_less_than_nominal_on_a_mix_and_all_of_it_on_one_length():
    """The recursion the policy derates a pipelined vPod by is the simulator's gated engines:
    one length passes its nominal rate, a mix of lengths less - by what the recursion says."""
    same = [3000] * 400
    got, nominal = _saturated_vpod_throughput(same)
    assert got == pytest.approx(nominal, rel=0.01)
    rng = np.random.default_rng(5)
    mixed = rng.choice([200, 600, 1500, 4000, 8000], 2000, p=[0.3, 0.3, 0.2, 0.15, 0.05])
    got, nominal = _saturated_vpod_throughput(mixed)
    assert got < 0.95 * nominal                               # the mix's loss is real
    e = PrefillEngine(affine(1 << 16), max_batch=1)
    lone = np.array([e.lone_prompt_s(int(n)) for n in mixed])
    model = pipeline_throughput((lone / 4).tolist(), [4.0] * len(lone), 4)
    assert model == pytest.approx(got, rel=0.02)
    cyc = lone / 4
    cv2 = float(cyc.var() / cyc.mean() ** 2)
    assert pipeline_efficiency(4, cv2) == pytest.approx(got / nominal, abs=0.05)


def test_only_batch1_pipelines_are_derated():
    assert gated_depth(Alloc("v6e", "4x2", 8, 2, 4, 1, 1)) == 4
    assert gated_depth(Alloc("v6e", "4x2", 8, 2, 4, 1, 4)) == 4
    assert gated_depth(Alloc("v6e", "4x2", 8, 2, 4, 1, 8)) == 1
    assert gated_depth(Alloc("v6e", "4x2", 8, 8, 1, 1, 1)) == 1
    assert pipeline_efficiency(1, 3.0) == 1.0 and pipeline_efficiency(4, 0.0) == 1.0
    effs = [pipeline_efficiency(4, x) for x in (0.05, 0.3, 1.0, 4.0)]
    assert all(a > b for a, b in zip(effs, effs[1:])) and 0.7 < effs[-1] < effs[0] < 1.0
    # sized at the derated throughput, a mix takes more vPods than one length
    _, s, eta = mix_slack([1.0, 8.0], [0.25, 2.0], [3.0, 24.0], [0.7, 0.3], depth=4)
    assert eta < 0.9
    assert servers_needed(20.0, ([0.7, 0.3], s, eta)) > servers_needed(20.0, ([0.7, 0.3], s))


def _decode_waits(n_vpods: int, k: int, arr, out, route: str) -> float:
    """Share of answers that waited for a batch slot on ``n_vpods`` decode vPods of ``k``
    slots, advanced in 10-s slices as the cluster simulator does: routed by
    :func:`router.routing.free_slot_first` on each vPod's projected slots (``"free"``, the
    drivers' rule) or by outstanding tokens known since the slice began (``"tokens"``, the
    rule before). An answer waited when it took longer than alone at a full batch."""
    from router.routing import free_slot_first, least_loaded

    vps = [VPodEngines([DecodeEngine(affine(1 << 20), max_batch=k)]) for _ in range(n_vpods)]
    step_s = vps[0]._decode_step_s(100 + int(out.max()))
    owed = [0] * n_vpods
    recs, t_slice = [], 10.0
    for t, o in zip(arr.tolist(), out.tolist()):
        while t >= t_slice:
            for i, v in enumerate(vps):
                owed[i] -= sum(r.output_tokens for r in v.advance_to(t_slice))
            t_slice += 10.0
        ids = range(n_vpods)
        i = (free_slot_first(ids, lambda j: vps[j].held_share(t), owed.__getitem__)
             if route == "free" else least_loaded(ids, owed.__getitem__))
        owed[i] += o
        recs.append(vps[i].submit(len(recs), t, 100, o))
    for v in vps:
        v.advance_to(1e9)
    warm = arr[-1] * 0.05
    waited = [r.finish_s - r.arrival_s > (r.output_tokens - 1) * step_s * 1.02
              for r in recs if r.arrival_s > warm]
    return float(np.mean(waited))


def test_a_decode_group_sized_as_one_pool_meets_its_wait_target_when_routed_to_free_slots():
    """The load-aware policy sizes a decode group as one queue of all its vPods' slots
    (``POOLED_DECODE``: Erlang C over n x k servers, at most 5 % of answers waiting). Four
    vPods of 8 slots at the load that sizing allows: answers routed to a vPod with a free
    slot (the gateway's and the simulator's rule) wait within the target (4.5 %); routed by
    tokens known since the slice began, as the simulator did, more of them wait (6.4 %),
    past the target - the blind split the rule before sized for (each vPod its own queue),
    which takes a vPod more here."""
    k, rng = 8, np.random.default_rng(7)
    out = rng.integers(5, 60, 60_000)
    probe = VPodEngines([DecodeEngine(affine(1 << 20), max_batch=k)])
    step_s = probe._decode_step_s(100 + int(out.max()))
    service_s = float((out - 1).mean()) * step_s
    # the most work (in vPods) four pooled vPods take at <= 5 % waiting
    a = max(x / 100 for x in range(100, 400)
            if servers_needed(x / 100, 0.0, k, pooled=True) <= 4)
    assert servers_needed(a, 0.0, k, pooled=False) > 4          # blind: more vPods
    rate = a * k / service_s
    arr = np.cumsum(rng.exponential(1.0 / rate, out.size))
    free = _decode_waits(4, k, arr, out, "free")
    blind = _decode_waits(4, k, arr, out, "tokens")
    assert free <= 0.05 * 1.1
    assert blind > 0.05 and blind > 1.25 * free
