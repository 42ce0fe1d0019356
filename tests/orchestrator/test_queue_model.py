"""The prefill queue model the load-aware policy sizes groups by (:func:`orchestrator.pricing.
mix_slack`, :func:`orchestrator.pricing.servers_needed`) against an event-by-event FCFS
M/G/k queue of a mix of prompt lengths: each class its own (deterministic) service time and
its own slack (SLO minus latency)."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest

from orchestrator.pricing import erlang_c, mix_slack, servers_needed


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
    ww, sl = mix_slack(s, s, d + s, w)
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


def test_one_length_is_the_rule_before():
    """One bucket: the slack is its SLO over its latency, minus 1, in cycles - as before."""
    w, s = mix_slack([2.0], [0.5], [3.0], [7.0])
    assert list(w) == [1.0] and s[0] == pytest.approx((3.0 / 2.0 - 1.0) * 2.0 / 0.5)
    for a in (0.4, 3.3, 17.0):
        assert servers_needed(a, (w, s)) == servers_needed(a, float(s[0]))


def test_sized_by_the_mix_a_pool_meets_the_target():
    """The fewest servers the mix test allows miss about 5 % in the queue simulation, one
    fewer clearly more; the tightest-class rule sizes the same load too small."""
    service, share, slack = (0.1, 1.0), (0.8, 0.2), (0.3, 1.0)
    mean = float(np.dot(share, service))
    load = 20.0                                                  # servers' worth of work
    w, s = mix_slack(service, service, np.add(slack, service), share)
    n = servers_needed(load, (w, s))
    old = servers_needed(load, min(d / x for d, x in zip(slack, service)))
    assert old < n
    rate = load / mean
    assert fcfs_miss(n, rate, service, share, slack) <= 0.05 * 1.25
    assert fcfs_miss(n - 1, rate, service, share, slack) > 0.05
    assert fcfs_miss(old, rate, service, share, slack) > 0.05 * 1.5


def test_no_requests_counts_the_buckets_alike_and_a_missed_slo_leaves_no_slack():
    w, s = mix_slack([1.0, 2.0], [1.0, 2.0], [0.5, 4.0], [0.0, 0.0])
    assert list(w) == [0.5, 0.5] and s[0] == 0.0 and s[1] > 0.0
