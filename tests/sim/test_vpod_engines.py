"""A pipeline-parallel vPod's virtual engines (:class:`sim.vpod.VPodEngines`): which engine a
request joins when the driver only tells the engines the time once per slice."""

from __future__ import annotations

import numpy as np
import pytest

from engine_cases import affine
from sim.fastengine import DecodeEngine, PrefillEngine
from sim.vpod import VPodEngines


def two_batch1_decoders() -> VPodEngines:
    return VPodEngines([DecodeEngine(affine(), max_batch=1) for _ in range(2)])


def test_a_short_answer_does_not_queue_behind_a_long_one():
    """Two batch-1 virtual engines, one slice: a 400-token answer and a 5-token one start at
    t=0; a third request arrives after the short one has finished but before the driver
    advances the engines. Counting unfinished requests (1 and 1, stale) ties and picks the
    first engine, behind the long answer; the work each engine holds picks the free one."""
    ve = two_batch1_decoders()
    long_ = ve.submit("long", 0.0, 100, 400)
    short = ve.submit("short", 0.0, 100, 5)
    assert ve.work == [400, 5] and ve.loads == [1, 1]
    ve.advance_to(0.0)
    third = ve.submit("third", 0.5, 100, 5)
    done = ve.advance_to(1e6)
    assert {r.req_id for r in done} == {"long", "short", "third"}
    assert short.finish_s < 0.5 < long_.finish_s                  # the premise: one is free
    alone = short.finish_s - short.arrival_s                       # the same answer, no wait
    assert third.finish_s - third.arrival_s == pytest.approx(alone, rel=0.05)
    assert ve.work == [0, 0] and ve.loads == [0, 0]


def test_work_is_prompt_tokens_for_prefill_and_given_back_on_abort():
    ve = VPodEngines([PrefillEngine(affine(1 << 16), max_batch=1) for _ in range(2)])
    ve.submit(0, 0.0, 3000, 1)
    ve.submit(1, 0.0, 200, 1)
    r = ve.submit(2, 0.0, 200, 1)                   # lighter engine: the second
    assert ve.work == [3000, 400] and ve.loads == [1, 2]
    assert ve.abort(r) and ve.work == [3000, 200] and ve.loads == [1, 1]
    ve.advance_to(1e6)
    assert ve.work == [0, 0] and ve.loads == [0, 0]


def test_time_ordered_handoffs_spread_over_the_virtual_engines():
    """Hand-offs from two prefill vPods within one 10-s slice (each vPod's in time order,
    spanning the slice) to one vPod of 8 batch-1 decode engines at a quarter of its slots:
    given in time order, few answers wait for a slot; given vPod after vPod (what the cluster
    simulator did), the second vPod's hand-offs land on engines that the first vPod's keep
    busy at the same moments."""
    rng = np.random.default_rng(3)
    n, span = 800, 100.0
    arr = np.sort(rng.uniform(0, span, n))
    out = rng.integers(5, 60, n)
    src = rng.integers(0, 2, n)                     # which prefill vPod handed it off

    def alone_s(o: int) -> float:                 # an answer's time with no wait
        e = DecodeEngine(affine(), max_batch=1)
        q = e.submit(0, 0.0, 100, o)
        e.advance_to(1e6)
        return q.finish_s

    alone = {int(o): alone_s(int(o)) for o in set(out)}

    def waited(order) -> float:
        ve = VPodEngines([DecodeEngine(affine(), max_batch=1) for _ in range(8)])
        recs = []
        for sl in range(int(span // 10)):
            for i in order:
                if sl * 10 <= arr[i] < sl * 10 + 10:
                    recs.append(ve.submit(int(i), float(arr[i]), 100, int(out[i])))
            ve.advance_to(sl * 10 + 10.0)
        ve.advance_to(1e6)
        assert len(recs) == n and all(r.finish_s is not None for r in recs)
        return float(np.mean([r.finish_s - r.arrival_s > 1.05 * alone[r.output_tokens]
                              for r in recs]))

    busy = sum(alone[int(o)] for o in out) / span
    assert 1.0 < busy < 3.0                        # a quarter of the 8 slots, roughly
    in_time = waited(list(range(n)))
    by_source = waited([i for s in (0, 1) for i in range(n) if src[i] == s])
    assert in_time < 0.1 and by_source > 2 * in_time
