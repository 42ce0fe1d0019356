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


def test_a_decode_request_takes_a_free_slot_that_stale_work_counts_hide():
    """Two batch-1 virtual engines and one slice (the driver advances them only at its end): a
    300-token answer starts on the first, then short answers arrive one after another, each
    after the one before has finished. The work counted since the slice began grows on the
    second engine until it passes the long answer's, and the rule before sent the next short
    answer behind the long one; the projected ends of what each engine was given
    (:meth:`VPodEngines._slot_at`) see the second engine free, and every short answer runs
    as fast as it does alone. Without an arrival time :meth:`VPodEngines.choose` keeps the
    work rule (the premise)."""
    def alone_s(o: int) -> float:
        e = DecodeEngine(affine(), max_batch=1)
        q = e.submit(0, 0.0, 100, o)
        e.advance_to(1e6)
        return q.finish_s

    d5 = alone_s(5)
    ve = two_batch1_decoders()
    long_ = ve.submit("long", 0.0, 100, 500)
    assert alone_s(500) > 110 * 1.05 * d5                # the long one outlasts the shorts
    shorts, stale = [], 0
    for i in range(110):
        if ve.work[1] >= ve.work[0]:                     # stale work picks the long one's
            assert ve.choose(100, 5) == 0
            stale += 1
        shorts.append(ve.submit(i, (i + 1) * 1.05 * d5, 100, 5))
    assert stale > 0 and ve.loads == [1, 110]            # the premise; all on the free one
    ve.advance_to(1e6)
    assert all(r.finish_s is not None for r in shorts) and long_.finish_s is not None
    assert max(r.finish_s - r.arrival_s for r in shorts) == pytest.approx(d5, rel=0.05)
    assert ve.work == [0, 0] and ve.loads == [0, 0]


def test_a_full_decode_engine_takes_the_next_request_when_its_first_slot_frees():
    """Both batch-2 engines full: the request goes to the engine whose earliest projected end
    comes first - the one holding more work (the rule before picked the other) but a short
    answer - and runs without waiting for a long one."""
    ve = VPodEngines([DecodeEngine(affine(), max_batch=2) for _ in range(2)])
    ve.submit_to(0, "a", 0.0, 100, 100)
    ve.submit_to(0, "c", 0.0, 100, 100)
    ve.submit_to(1, "b", 0.0, 100, 20)
    ve.submit_to(1, "d", 0.0, 100, 400)
    assert ve.work == [200, 420] and ve.choose(100, 10) == 0      # work: the first
    assert ve._slot_at(1, 0.0) < ve._slot_at(0, 0.0)             # "b" ends first
    assert ve.choose(100, 10, 0.0) == 1
    e = ve.submit("e", 0.0, 100, 10)
    recs = {r.req_id: r for r in ve.advance_to(1e6)}
    assert e.finish_s < recs["a"].finish_s                      # it did not wait for a or c
    assert e.finish_s - recs["b"].finish_s < 0.5 * (recs["a"].finish_s - recs["b"].finish_s)


def test_held_share_counts_the_slots_projected_busy_at_a_time():
    """One batch-4 engine given three answers at t=0: three quarters of its slots held until
    the shortest is projected to end, none once the longest is - without advancing it."""
    ve = VPodEngines([DecodeEngine(affine(), max_batch=4)])
    for i, o in enumerate((10, 50, 200)):
        ve.submit(i, 0.0, 100, o)
    step = ve._decode_step_s(100 + 25)
    assert ve.slots == 4 and ve.held_share(0.0) == 0.75
    assert ve.held_share(20 * step) == 0.5
    assert ve.held_share(250 * ve._decode_step_s(200)) == 0.0
    assert ve.loads == [3]                              # the engine itself not advanced


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


def _pp_prefill(depth: int, n_engines: int = 4) -> VPodEngines:
    return VPodEngines([PrefillEngine(affine(1 << 16), max_batch=1) for _ in range(n_engines)],
                       depth=depth)


def test_a_pipelines_first_stage_admits_one_prompt_per_stage_time():
    """Four equal prompts at t=0 on a PP4 vPod's four batch-1 virtual engines: each engine
    takes one, but the first stage passes one first chunk per stage time (a quarter of the
    lone step), so they start a stage apart and finish L, 1.25 L, 1.5 L, 1.75 L - not all
    at L, four prompts through a stage in the time of one."""
    ve = _pp_prefill(4)
    lone = ve.service_s(2000)
    assert ve.stage_s(2000) == pytest.approx(lone / 4)
    recs = [ve.submit(i, 0.0, 2000, 1) for i in range(4)]
    assert ve.backlog_s(0.0)[0] == pytest.approx(lone)   # the next start: an engine free
    ve.advance_to(1e6)
    assert sorted(r.first_token_s for r in recs) == pytest.approx(
        [lone * (1 + i / 4) for i in range(4)])
    assert all(r.arrival_s == 0.0 for r in recs)         # TTFT still counts from arrival


def test_the_gate_costs_a_full_pipeline_no_throughput_and_a_lone_vpod_nothing():
    """40 equal prompts at once: the stage-time offsets persist, so the pipeline still passes
    ``depth`` prompts per lone step (the last finishes at 9.75 L + L, not 10 L + its offset
    piled up); an unpipelined vPod's engines start together as before."""
    ve = _pp_prefill(4)
    lone = ve.service_s(2000)
    recs = [ve.submit(i, 0.0, 2000, 1) for i in range(40)]
    ve.advance_to(1e6)
    assert max(r.first_token_s for r in recs) == pytest.approx(lone * (39 / 4 + 1))
    flat = _pp_prefill(1)
    recs = [flat.submit(i, 0.0, 2000, 1) for i in range(4)]
    flat.advance_to(1e6)
    assert [r.first_token_s for r in recs] == pytest.approx([lone] * 4)
    assert flat.backlog_s(0.0)[0] == pytest.approx(lone)


def test_a_waiting_stage_shows_in_the_backlog():
    """One long prompt just started on an idle PP4 vPod: three engines are free, but the
    next prompt waits for its first chunk to leave the first stage - what the router sees."""
    ve = _pp_prefill(4)
    ve.submit(0, 0.0, 8000, 1)
    wait, _ = ve.backlog_s(0.0)
    assert wait == pytest.approx(ve.stage_s(8000)) and wait > 0
    r = ve.submit(1, 0.0, 100, 1)
    ve.advance_to(1e6)
    assert r.first_token_s == pytest.approx(wait + ve.service_s(100))


def test_only_a_pipelines_batch1_prefill_engines_are_gated():
    """The gate needs each virtual engine's micro-batch to be one prompt: a batched engine's
    step passes several through the first stage sharing its weight reads (and its projected
    free time is only an upper bound), and decode has no prompts to admit."""
    from engine_cases import chip_table
    from sim.vpod import vpod_engines
    t = chip_table()
    assert vpod_engines(t, "prefill", 1, 4, 8192, 0.0).depth == 4
    assert vpod_engines(t, "prefill", 4, 4, 8192, 0.0).depth == 4      # 1 per engine
    assert vpod_engines(t, "prefill", 8, 4, 8192, 0.0).depth == 1      # 2 per engine
    assert vpod_engines(t, "prefill", 1, 1, 8192, 0.0).depth == 1
    assert vpod_engines(t, "decode", 4, 4, 8192, 0.0).depth == 1


def test_a_prompt_behind_a_busy_engine_does_not_hold_the_stage_until_then():
    """A router that gives a prompt to a busy virtual engine (``submit_to``) reserves the
    first stage for when that engine frees, not from now: a later prompt on an idle engine
    passes the stage in the gap."""
    ve = _pp_prefill(4)
    long_ = ve.submit_to(0, "long", 0.0, 8000, 1)     # engine 0 busy for a whole pass
    held = ve.submit_to(0, "held", 0.0, 2000, 1)      # waits for engine 0
    free = ve.submit_to(1, "free", 0.0, 2000, 1)      # engine 1 is idle
    ve.advance_to(1e6)
    pass_8000 = ve.service_s(8000)
    assert held.first_token_s == pytest.approx(pass_8000 + ve.service_s(2000))
    # the idle engine starts once the long prompt's first chunk has left the stage
    assert free.first_token_s == pytest.approx(ve.stage_s(8000) + ve.service_s(2000))
    assert long_.first_token_s == pytest.approx(pass_8000)


def test_a_busy_stage_is_one_reservation_however_many_prompts_wait():
    """400 prompts at once on a PP4 vPod: the stage's back-to-back reservations are one block,
    so finding the next slot does not walk the queue (the 64x sweep's Base pools hold
    thousands of waiting prompts on hundreds of vPods, searched at every arrival), and the
    schedule is the one the block stands for: the next free slot at its end; a prompt given
    to a busy engine keeps its own block until the gap before it is filled."""
    ve = _pp_prefill(4)
    stage = ve.stage_s(2000)
    for i in range(400):
        ve.submit(i, 0.0, 2000, 1)
    assert len(ve._stage) == 1
    assert ve.stage_free_s == pytest.approx(400 * stage)
    assert ve._stage_slot(0.0, stage) == pytest.approx(400 * stage)
    gap = ve.submit_to(1, "later", 0.0, 2000, 1)       # engine 1's turn comes later still
    assert ve.free_at[1] > ve.stage_free_s - stage
    ve.advance_to(1e7)
    assert gap.first_token_s >= 400 * stage


def _batched_prefill(max_batch: int = 4, start_s: float = 0.0) -> VPodEngines:
    return VPodEngines([PrefillEngine(affine(1 << 16), max_batch=max_batch,
                                      start_s=start_s)])


def test_a_batched_engines_projected_free_time_follows_its_batches():
    """A batch-4 prefill engine given a queue: each prompt behind a busy step joins a step
    with others, so it adds its share of a full step to the engine's free time, not its lone
    time. The projection made at submission (nothing advanced) lands within 15 % of when the
    engine really finishes; projected at lone times it would be about twice as far (short
    prompts: the step's fixed cost dominates, and four share it)."""
    ve = _batched_prefill()
    rng = np.random.default_rng(5)
    lens = rng.integers(32, 256, 300)
    for i, n in enumerate(lens):
        ve.submit(i, 0.0, int(n), 1)
    projected = ve.free_at[0]
    done = ve.advance_to(1e9)
    assert len(done) == len(lens)
    finish = max(r.finish_s for r in done)
    assert projected == pytest.approx(finish, rel=0.15)
    lone = sum(ve.service_s(int(n)) for n in lens)
    assert lone > 2.0 * finish
    # an idle engine starts a prompt alone: its lone time
    idle = _batched_prefill()
    idle.submit(0, 5.0, 200, 1)
    assert idle.free_at[0] == pytest.approx(5.0 + idle.service_s(200))
    assert idle.batched_s(200) < 0.6 * idle.service_s(200)


def test_a_new_batched_vpod_takes_its_share_not_every_prompt():
    """Prompts routed to the vPod that can start one soonest (the cluster simulator's rule,
    within a slice that advances nothing): two batch-4 vPods under a load 1.5x what one
    serves, a second vPod coming up while the first has a queue. The newcomer takes about
    half of what follows and no prompt waits long; with the busy vPod's free time projected
    at lone prompt times it looked busy far past its real queue, and the newcomer took every
    prompt until its own projection caught up."""
    rng = np.random.default_rng(6)
    a = _batched_prefill()
    one_s = a.engines[0].batched_prompt_s(128)   # a full step's share: a vPod's capacity
    gap = one_s / 1.5
    t, arrivals = 0.0, []
    while t < 20.0:
        t += rng.exponential(gap)
        arrivals.append(t)
    b, queued_s = None, 0.0
    where = []
    for i, t in enumerate(arrivals):
        if b is None and t >= 10.0:
            a.advance_to(10.0)
            queued_s = a.engines[0].num_waiting * one_s    # the first vPod's real queue
            b = _batched_prefill(start_s=10.0)
        vs = [a] if b is None else [a, b]
        v = min(vs, key=lambda x: x.backlog_s(t))
        v.submit(i, t, 128, 1)
        where.append((t, v is b))
    late = [on_b for t, on_b in where if t >= 10.0]
    assert 0.3 < sum(late) / len(late) < 0.7
    done = a.advance_to(1e9) + b.advance_to(1e9)
    ttft = [r.finish_s - r.arrival_s for r in done if r.arrival_s >= 15.0]
    assert queued_s > 2.0
    # shared, the queue drains: half-way through, most prompts wait well under what it was
    assert np.percentile(ttft, 90) < 0.5 * queued_s
