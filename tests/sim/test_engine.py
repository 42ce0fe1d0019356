"""The simulated engine (sim/engine.py): hand-checked schedules on an affine step cost, KV-cache
admission and swapping, the P/D modes, energy accounting, and the vectorised fast path against
the one-step-per-iteration reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from engine_cases import affine as workload_cost
from engine_cases import workload
from sim.engine import AffineStepCost, Engine, Request

# Hand-checkable cost: 2 chips x 10 W static.
#   prefill of 100 fresh tokens: max(1e-3 + 100e-4 + 5050e-7, 5e-3) = 0.011505 s
#   decode of one sequence at KV L: max(1e-3 + 1e-4, 5e-3 + 1e-6 L) = 0.005 + 1e-6 L s
HAND = dict(num_chips=2, static_power_w=10.0, kv_capacity_tokens=1024, kv_bytes_per_token=1000.0,
            host_bw_bytes_per_s=1e6, c0_s=1e-3, c_tok_s=1e-4, c_ctx_s=1e-7, c_seq_s=1e-4,
            m0_s=5e-3, m_kv_s=1e-6, e_tok_j=0.01, e_ctx_j=1e-5, e_seq_j=0.1, e_kv_j=1e-3)
PREFILL_100_S = 0.011505


def hand_cost(**kw: float) -> AffineStepCost:
    return AffineStepCost(**{**HAND, **kw})


@dataclass
class Recorder:
    """A StepCost that forwards to another and records every call (arguments broadcast)."""

    inner: AffineStepCost
    calls: list[tuple[np.ndarray, ...]] = field(default_factory=list)

    def __getattr__(self, name: str):            # num_chips, static_power_w, ... of inner
        return getattr(self.inner, name)

    def step(self, prefill_tokens, prefill_ctx, n_decode, decode_kv):
        args = np.broadcast_arrays(*(np.atleast_1d(np.asarray(a, dtype=float))
                                     for a in (prefill_tokens, prefill_ctx, n_decode, decode_kv)))
        self.calls.append(tuple(args))
        return self.inner.step(prefill_tokens, prefill_ctx, n_decode, decode_kv)

    def flat(self) -> np.ndarray:
        """All evaluated steps as rows (prefill_tokens, prefill_ctx, n_decode, decode_kv)."""
        return np.concatenate([np.stack(c, axis=1) for c in self.calls])

    @property
    def points(self) -> int:
        return sum(len(c[0]) for c in self.calls)


def by_id(reqs: list[Request]) -> dict:
    return {r.req_id: r for r in reqs}


# ---------------------------------------------------------------------- one request by hand

@pytest.mark.parametrize("exact", [True, False])
def test_single_request_by_hand(exact):
    e = Engine(hand_cost(), exact=exact)
    e.submit("a", 1.0, prompt_tokens=100, output_tokens=5)
    (r,) = e.run_until_idle()
    decode_s = 4 * 0.005 + 1e-6 * (101 + 102 + 103 + 104)     # KV 101..104: 0.02041 s
    assert r.first_token_s == pytest.approx(1.0 + PREFILL_100_S, rel=1e-12)
    assert r.ttft_s == pytest.approx(PREFILL_100_S, rel=1e-12)
    assert r.finish_s == pytest.approx(1.0 + PREFILL_100_S + decode_s, rel=1e-12)
    assert r.tpot_s == pytest.approx(decode_s / 4, rel=1e-12)
    assert r.generated_tokens == 5 and r.preemptions == 0
    s = e.stats()
    assert s.steps == 5 and s.prefill_tokens == 100 and s.decode_tokens == 4
    # 20 W over [0, finish] (idle second included) + dynamic energy of the steps
    dynamic_j = 0.01 * 100 + 1e-5 * 5050 + 0.1 * 4 + 1e-3 * 410
    assert s.energy_j == pytest.approx(20.0 * r.finish_s + dynamic_j, rel=1e-12)
    if not exact:          # one scalar call for the prefill, one vector for the four decodes
        assert s.cost_calls == 2 and s.cost_points == 5
    assert s.chip_s == pytest.approx(2 * r.finish_s, rel=1e-12)
    assert s.busy_s == pytest.approx(PREFILL_100_S + decode_s, rel=1e-12)
    assert e.free_kv_tokens == 1024 and e.idle


@pytest.mark.parametrize("exact", [True, False])
def test_advance_to_finishes_the_step_in_flight(exact):
    e = Engine(hand_cost(), exact=exact)
    e.submit("a", 1.0, 100, 5)
    # steps end at 1.011505, 1.016606, 1.021708, ...: the one starting at 1.016606 < 1.02 runs
    assert e.advance_to(1.02) == []
    assert e.now_s == pytest.approx(1.0 + PREFILL_100_S + 0.010203, rel=1e-12)
    assert e.requests["a"].generated_tokens == 3
    assert e.advance_to(e.now_s) == []                  # nothing starts before the clock
    (r,) = e.advance_to(5.0)
    assert r.req_id == "a" and e.now_s == 5.0           # idle until the target time
    assert e.advance_to(6.0) == []                      # reported once


def test_next_event_time_is_the_end_of_the_step_run():
    fast = Engine(hand_cost())
    fast.submit("a", 1.0, 100, 5)
    assert fast.next_event_time() == 1.0                 # idle until the arrival
    fast.advance_to(1.0)
    t_first = fast.next_event_time()                     # the prefill step
    assert t_first == pytest.approx(1.0 + PREFILL_100_S, rel=1e-12)
    fast.advance_to(t_first)
    # the four decode steps form one run: next change is the finish
    assert fast.next_event_time() == pytest.approx(1.031915, rel=1e-12)
    assert [r.req_id for r in fast.advance_to(fast.next_event_time())] == ["a"]
    assert fast.next_event_time() is None
    exact = Engine(hand_cost(), exact=True)
    exact.submit("a", 1.0, 100, 5)
    exact.advance_to(1.0 + PREFILL_100_S)
    assert exact.next_event_time() == pytest.approx(1.0 + PREFILL_100_S + 0.005101, rel=1e-12)


# ---------------------------------------------------------------------- batching

def test_chunked_prefill_over_several_steps():
    rec = Recorder(hand_cost())
    e = Engine(rec, max_batch=8, max_batched_tokens=64, exact=True)
    e.submit("long", 0.0, prompt_tokens=200, output_tokens=2)
    (r,) = e.run_until_idle()
    rows = rec.flat()
    assert rows[:, 0].tolist() == [64, 64, 64, 8, 0]
    # context of a chunk of n tokens at position p: n*p + n(n+1)/2
    assert rows[:4, 1].tolist() == [2080, 64 * 64 + 2080, 64 * 128 + 2080, 8 * 192 + 36]
    assert rows[4, 2:].tolist() == [1, 201]                # then one decode at KV 201
    lat = rec.inner.step(*rows.T)[0]
    assert r.first_token_s == pytest.approx(lat[:4].sum(), rel=1e-12)
    assert r.finish_s == pytest.approx(lat.sum(), rel=1e-12)


@pytest.mark.parametrize("exact", [True, False])
def test_continuous_batching_respects_max_batch_and_token_budget(exact):
    rec = Recorder(hand_cost())
    e = Engine(rec, max_batch=4, max_batched_tokens=64, exact=exact)
    for i in range(10):
        e.submit(i, 0.0, prompt_tokens=40, output_tokens=20 + i)
    done = []
    while not e.idle:
        done += e.advance_to(e.next_event_time())
        assert e.num_running <= 4
    rows = rec.flat()
    assert np.all(rows[:, 0] + rows[:, 2] <= 64)            # prefill + decode tokens per step
    assert np.all(rows[:, 2] <= 4)
    # step 0: prompt 0 (40 tokens, context 820) and the first 24 tokens of prompt 1 (300)
    assert rows[0].tolist() == [64, 820 + 300, 0, 0]
    # step 1: request 0 decodes first (KV 41); 63 tokens left: the last 16 of prompt 1 (at
    # position 24: 16*24 + 136), prompt 2 (820), the first 7 of prompt 3 (28)
    assert rows[1].tolist() == [63, 520 + 820 + 28, 1, 41]
    # step 2: three decodes, the rest of prompt 3 (33 at position 7); 28 tokens of budget are
    # left, but the batch holds max_batch=4 sequences, so request 4 waits
    assert rows[2].tolist() == [33, 33 * 7 + 33 * 34 / 2, 3, 42 + 41 + 41]
    assert rows[3].tolist() == [0, 0, 4, 43 + 42 + 42 + 41]
    reqs = e.requests
    first_finish_s = min(r.finish_s for r in done)
    assert all(reqs[i].first_token_s >= first_finish_s for i in range(4, 10))
    assert all(r.generated_tokens == r.output_tokens for r in done) and len(done) == 10
    assert e.stats().decode_tokens == sum(20 + i - 1 for i in range(10))


@pytest.mark.parametrize("exact", [True, False])
def test_prefix_kv_is_not_recomputed_except_the_last_token(exact):
    rec = Recorder(hand_cost())
    e = Engine(rec, exact=exact)
    e.submit("half", 0.0, prompt_tokens=100, output_tokens=1, kv_ready_tokens=60)
    e.run_until_idle()
    e.submit("all", 1.0, prompt_tokens=100, output_tokens=1, kv_ready_tokens=100)
    e.run_until_idle()
    rows = rec.flat()
    assert rows[0].tolist() == [40, 40 * 60 + 40 * 41 / 2, 0, 0]
    assert rows[1].tolist() == [1, 99 + 1, 0, 0]                 # vLLM recomputes one token
    assert e.stats().prefill_tokens == 41


# ---------------------------------------------------------------------- KV cache

@pytest.mark.parametrize("exact", [True, False])
def test_admission_waits_for_kv_blocks(exact):
    # 10 blocks of 16; a 100-token prompt takes 7: the second request waits for the first
    e = Engine(hand_cost(kv_capacity_tokens=160), exact=exact)
    e.submit("a", 0.0, 100, 3)
    e.submit("b", 0.0, 100, 3)
    e.advance_to(0.001)
    assert e.num_running == 1 and e.num_waiting == 1
    assert e.free_kv_tokens == 3 * 16
    reqs = by_id(e.run_until_idle())
    a, b = reqs["a"], reqs["b"]
    assert a.finish_s == pytest.approx(PREFILL_100_S + 0.005101 + 0.005102, rel=1e-12)
    assert b.first_token_s == pytest.approx(a.finish_s + PREFILL_100_S, rel=1e-12)
    assert e.stats().preemptions == 0


def run_swap_scenario(exact: bool, host_bw: float, cost_log: list | None = None) -> Engine:
    # 8 blocks of 16 tokens. Two 32-token prompts (2 blocks each) decoding 59 tokens each would
    # need 6 blocks each. Both take new blocks at KV 33 and 49; at KV 65 the older one (a) needs
    # a block, none is free: b, the most recently admitted, is swapped out with 64 tokens of KV.
    # It needs 5 blocks to come back, which a leaves only when it finishes.
    rec = Recorder(hand_cost(kv_capacity_tokens=128, host_bw_bytes_per_s=host_bw))
    e = Engine(rec, exact=exact)
    e.submit("a", 0.0, 32, 60)
    e.submit("b", 0.0, 32, 60)
    e.run_until_idle()
    if cost_log is not None:
        cost_log.extend(rec.calls)
    return e


@pytest.mark.parametrize("exact", [True, False])
def test_preemption_swaps_the_newest_and_loses_nothing(exact):
    calls: list = []
    e = run_swap_scenario(exact, host_bw=1e6, cost_log=calls)
    a, b = e.requests["a"], e.requests["b"]
    s = e.stats()
    assert s.preemptions == 1 and a.preemptions == 0 and b.preemptions == 1
    swap_one_s = 64 * 1000.0 / 1e6                         # 64 tokens x 1000 B at 1 MB/s
    assert s.swap_s == pytest.approx(2 * swap_one_s, rel=1e-12)   # out, then back in
    assert b.first_token_s < a.finish_s < b.finish_s
    for r in (a, b):
        assert r.generated_tokens == 60 and r.kv_tokens == 32 + 59
    assert s.prefill_tokens == 64 and s.decode_tokens == 2 * 59
    assert e.free_kv_tokens == 128
    if not exact:
        # prefill; 32 decode steps of both (KV 33..64: 66, 68, ... summed) priced as one vector,
        # cut exactly where the closed form says the blocks run out; the preemption step; a
        # alone to its end; b swapped back in; b alone to its end
        assert [len(c[0]) for c in calls] == [1, 32, 1, 26, 1, 26]
        assert calls[1][3].tolist() == [2 * kv for kv in range(33, 65)]
        assert [c[3][0] for c in calls[2:]] == [65, 66, 65, 66]
    assert s.steps == 87 == s.cost_points
    # the swap costs exactly its time: same schedule, shifted
    free = run_swap_scenario(exact, host_bw=1e30)
    fa, fb = free.requests["a"], free.requests["b"]
    assert free.stats().preemptions == 1
    assert a.finish_s - fa.finish_s == pytest.approx(swap_one_s, rel=1e-9)
    assert b.finish_s - fb.finish_s == pytest.approx(2 * swap_one_s, rel=1e-9)
    assert s.energy_j - free.stats().energy_j == pytest.approx(20.0 * 2 * swap_one_s, rel=1e-9)


def test_request_larger_than_the_kv_cache_is_refused():
    e = Engine(hand_cost(kv_capacity_tokens=128))
    with pytest.raises(ValueError, match="KV tokens"):
        e.submit("x", 0.0, 100, 40)                         # 139 KV tokens > 128
    e.submit("y", 0.0, 100, 29)                             # 128: fits exactly
    with pytest.raises(ValueError, match="duplicate"):
        e.submit("y", 0.0, 1, 1)
    assert e.run_until_idle()[0].generated_tokens == 29


# ---------------------------------------------------------------------- P/D modes

@pytest.mark.parametrize("exact", [True, False])
def test_prefill_mode_hands_off_after_the_first_token(exact):
    rec = Recorder(hand_cost())
    e = Engine(rec, mode="prefill", exact=exact)
    for i in range(3):
        e.submit(i, 0.0, 100, 50)
    out = e.run_until_idle()
    assert len(out) == 3 and len(rec.calls) == 1            # all three in one prefill step
    assert rec.flat()[0].tolist() == [300, 3 * 5050, 0, 0]
    lat = rec.inner.step(300, 3 * 5050, 0, 0)[0]
    for r in out:
        assert r.prefill_done and r.generated_tokens == 1
        assert r.finish_s == r.first_token_s == pytest.approx(float(lat), rel=1e-12)
        assert r.tpot_s is None
    assert e.stats().decode_tokens == 0 and e.free_kv_tokens == 1024


@pytest.mark.parametrize("exact", [True, False])
def test_decode_mode_only_decodes(exact):
    rec = Recorder(hand_cost())
    e = Engine(rec, mode="decode", exact=exact)
    e.submit("a", 2.0, 100, 5)                              # prompt KV arrives with it
    e.submit("one", 2.0, 100, 1)                            # nothing left to decode
    out = by_id(e.run_until_idle())
    rows = rec.flat()
    assert np.all(rows[:, :2] == 0)
    assert rows[:, 3].tolist() == [101, 102, 103, 104] and np.all(rows[:, 2] == 1)
    a = out["a"]
    assert a.ttft_s == 0.0 and not a.prefill_done
    assert a.finish_s == pytest.approx(2.0 + 0.02041, rel=1e-12)
    assert a.tpot_s == pytest.approx(0.02041 / 4, rel=1e-12)
    assert out["one"].finish_s == 2.0
    assert e.stats().prefill_tokens == 0 and e.stats().decode_tokens == 4


# ---------------------------------------------------------------------- energy and time

def test_idle_time_costs_static_power_and_chip_seconds_count_elapsed_time():
    e = Engine(hand_cost())
    e.advance_to(10.0)
    s = e.stats()
    assert s.energy_j == pytest.approx(2 * 10.0 * 10.0) and s.chip_s == pytest.approx(20.0)
    assert s.busy_s == 0.0 and s.idle_s == pytest.approx(10.0)
    # a vPod that comes up at its first request's arrival
    late = Engine(hand_cost(), start_s=None)
    assert late.advance_to(3.0) == [] and late.now_s is None
    late.submit("a", 5.0, 100, 1)
    late.advance_to(7.0)
    s = late.stats()
    assert s.elapsed_s == pytest.approx(2.0) and s.chip_s == pytest.approx(4.0)
    dynamic_j = 0.01 * 100 + 1e-5 * 5050
    assert s.energy_j == pytest.approx(20.0 * 2.0 + dynamic_j, rel=1e-12)
    assert s.idle_s == pytest.approx(2.0 - PREFILL_100_S, rel=1e-12)


# ---------------------------------------------------------------------- fast vs exact

def run_workload(seed: int, exact: bool) -> tuple[Engine, Recorder]:
    rec = Recorder(workload_cost())
    e = Engine(rec, max_batch=32, max_batched_tokens=512, exact=exact)
    for req in workload(seed):
        e.submit(*req)
    assert len(e.run_until_idle()) == 200
    return e, rec


def assert_same_results(a: Engine, b: Engine, rtol: float = 1e-3) -> None:
    ids = sorted(a.requests)
    assert ids == sorted(b.requests)
    for attr in ("first_token_s", "finish_s", "ttft_s"):
        np.testing.assert_allclose([getattr(b.requests[i], attr) for i in ids],
                                   [getattr(a.requests[i], attr) for i in ids], rtol=rtol)
    tpot = [i for i in ids if a.requests[i].tpot_s is not None]
    np.testing.assert_allclose([b.requests[i].tpot_s for i in tpot],
                               [a.requests[i].tpot_s for i in tpot], rtol=rtol)
    assert b.stats().energy_j == pytest.approx(a.stats().energy_j, rel=rtol)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_mode_agrees_with_exact_mode_with_far_fewer_evaluations(seed):
    ref, ref_rec = run_workload(seed, exact=True)
    fast, fast_rec = run_workload(seed, exact=False)
    assert_same_results(ref, fast)
    rs, fs = ref.stats(), fast.stats()
    assert rs.preemptions > 50 and fs.preemptions == rs.preemptions      # small KV cache
    assert fs.steps == rs.steps and fs.decode_tokens == rs.decode_tokens
    assert fs.decode_tokens == sum(o - 1 for *_, o in workload(seed))
    assert all(r.generated_tokens == r.output_tokens for r in fast.finished)
    # the reference evaluates one step per call; the fast path one vector per run of steps
    assert len(ref_rec.calls) == ref_rec.points == rs.steps == rs.cost_calls
    assert len(fast_rec.calls) == fs.cost_calls and fast_rec.points == fs.cost_points
    assert fs.cost_calls * 8 < rs.cost_calls
    assert fs.iterations * 8 < rs.iterations
    assert fs.cost_points < 1.3 * rs.steps                  # little priced and thrown away


def run_up_front(reqs: list) -> Engine:
    """The reference for the driving tests: everything submitted, then run to the end."""
    ref = Engine(workload_cost(), max_batch=32, max_batched_tokens=512)
    for req in reqs:
        ref.submit(*req)
    ref.run_until_idle()
    return ref


@pytest.mark.parametrize("dt_s", [0.001, 0.0137])
def test_small_increments_with_just_in_time_submission_match_one_big_advance(dt_s):
    reqs = workload(7, n=150)
    ref = run_up_front(reqs)
    inc = Engine(workload_cost(), max_batch=32, max_batched_tokens=512)
    got: list[Request] = []
    i, t_s = 0, 0.0
    while len(got) < len(reqs):                              # a real-time style loop
        t_s += dt_s
        while i < len(reqs) and reqs[i][1] <= t_s:
            inc.submit(*reqs[i])
            i += 1
        got += inc.advance_to(t_s)
    assert len({r.req_id for r in got}) == len(reqs)
    assert inc.stats().preemptions == ref.stats().preemptions > 0
    ref.advance_to(inc.now_s)                                # same horizon for the idle energy
    assert_same_results(ref, inc)
    assert inc.stats().chip_s == pytest.approx(ref.stats().chip_s)


def test_event_driven_loop_matches_one_big_advance():
    reqs = workload(3, n=150)
    ref = run_up_front(reqs)
    des = Engine(workload_cost(), max_batch=32, max_batched_tokens=512)
    i, got = 0, []
    while len(got) < len(reqs):                              # a discrete-event simulator
        t_engine = des.next_event_time()
        if i < len(reqs) and (t_engine is None or reqs[i][1] <= t_engine):
            got += des.advance_to(reqs[i][1])
            des.submit(*reqs[i])
            i += 1
        else:
            got += des.advance_to(t_engine)
    assert_same_results(ref, des)
    assert des.stats().cost_calls < 1.2 * ref.stats().cost_calls
