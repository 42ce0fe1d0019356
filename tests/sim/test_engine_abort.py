"""Aborting a request (``abort(record)``, :class:`sim.engine.SimEngine`) in every engine: a
request aborted before any step leaves exactly the schedule of an engine that never had it; one
aborted mid-run leaves the batch at the clock, and the event-driven engines then do exactly what
the reference engine (one step per iteration) does after the same abort; the KV blocks, the
counts and the energy stay consistent, and an aborted request is never reported finished."""

from __future__ import annotations

import pytest

from engine_cases import affine
from engine_cases import workload as requests
from sim.engine import Engine, SimEngine
from sim.fastengine import DecodeEngine, PrefillEngine
from sim.vpod import VPodEngines

# name -> (factory, side); small batches and KV caches: admission waits, preemptions
ENGINES = {
    "mixed": (lambda c: Engine(c, max_batch=8, max_batched_tokens=512), "mixed"),
    "mixed-exact": (lambda c: Engine(c, max_batch=8, max_batched_tokens=512, exact=True),
                    "mixed"),
    "prefill-mode": (lambda c: Engine(c, mode="prefill", max_batch=4,
                                      max_batched_tokens=1024), "prefill"),
    "decode-mode": (lambda c: Engine(c, mode="decode", max_batch=8,
                                     max_batched_tokens=512), "decode"),
    "PrefillEngine": (lambda c: PrefillEngine(c, max_batch=4, max_batched_tokens=1024),
                      "prefill"),
    "DecodeEngine": (lambda c: DecodeEngine(c, max_batch=8, max_batched_tokens=512),
                     "decode"),
    "DecodeEngine-short-runs": (lambda c: DecodeEngine(c, max_batch=8, max_batched_tokens=512,
                                                       max_run_steps=5), "decode"),
}


def cost_for(side: str, kv: int = 4096):
    return affine(kv if side != "prefill" else 1 << 16)


def workload(side: str, crowded: bool) -> list[tuple[int, float, int, int]]:
    """``crowded``: a dozen requests at t=0 (more than a batch) then Poisson arrivals; else
    three at t=0 and the rest later."""
    first = 12 if crowded else 3
    if side == "prefill":
        later = requests(11, 30, 0.01, prompt=(16, 1500), output=(1, 2))
    else:
        later = requests(12, 30, 0.05, prompt=(16, 400), output=(2, 200))
    head = [(100 + i, 0.0, 40 + 37 * i, 1 if side == "prefill" else 30 + 11 * i)
            for i in range(first)]
    return head + [(i, 0.05 + t, p, o) for i, t, p, o in later]


def outcome(records) -> dict:
    return {r.req_id: (r.first_token_s, r.finish_s, r.preemptions) for r in records}


def assert_close(got: dict, want: dict, rel: float = 1e-9) -> None:
    """Same requests, times to ``rel``, same preemption counts."""
    assert set(got) == set(want)
    for k, (ft, fin, pre) in got.items():
        assert ft == pytest.approx(want[k][0], rel=rel, abs=1e-12), k
        assert fin == pytest.approx(want[k][1], rel=rel, abs=1e-12), k
        assert pre == want[k][2], k


def finish_all(e: SimEngine) -> list:
    got = list(e.advance_to(e.now_s))
    got += e.run_until_idle()
    return got


def check_idle(e: SimEngine) -> None:
    """Idle after the run: no work left, every KV block free, sane counters."""
    assert e.idle and e.num_running == e.num_waiting == 0
    assert e.free_kv_tokens == e.kv_capacity_tokens
    st = e.stats()
    for name in ("now_s", "elapsed_s", "busy_s", "idle_s", "swap_s", "energy_j", "chip_s",
                 "prefill_tokens", "decode_tokens", "steps", "preemptions", "cost_calls",
                 "cost_points", "iterations", "finished"):
        assert getattr(st, name) >= 0, name
    assert st.idle_s == pytest.approx(st.elapsed_s - st.busy_s, abs=1e-9)


# ---- abort before any step: exactly the engine that never had the request --------------------

@pytest.mark.parametrize("planned", [False, True], ids=["unplanned", "planned"])
@pytest.mark.parametrize("crowded", [False, True], ids=["sparse", "crowded"])
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_abort_at_zero_is_never_having_submitted(name, crowded, planned):
    """Abort at t=0 before any step: a request admitted at 0 (running), one queued at 0 and the
    first later arrival. ``planned``: the engine has planned the step at 0 (a server calls
    ``next_event_time()`` after every change), so admissions made there are taken back."""
    make, side = ENGINES[name]
    cost = cost_for(side)
    reqs = workload(side, crowded)
    e = make(cost)
    recs = {r[0]: e.submit(*r) for r in reqs}
    if planned:
        assert e.next_event_time() > 0.0
        if isinstance(e, DecodeEngine):              # it admits when it plans
            assert e.num_running > 0
    head = [r[0] for r in reqs if r[1] == 0.0]
    gone = [head[1], head[-1], next(r[0] for r in reqs if r[1] > 0)]
    n_run = e.num_running
    for i in gone:
        assert e.abort(recs[i]) is True
        assert e.abort(recs[i]) is False                   # once only
    assert e.num_running <= n_run
    got = finish_all(e)
    ref = make(cost)
    for r in reqs:
        if r[0] not in gone:
            ref.submit(*r)
    want = finish_all(ref)
    assert outcome(got) == outcome(want)                  # bit for bit
    assert all(recs[i].finish_s is None for i in gone)
    e.advance_to(ref.now_s)
    ref.advance_to(e.now_s)
    s, r = e.stats(), ref.stats()
    for field in ("now_s", "busy_s", "swap_s", "energy_j", "prefill_tokens", "decode_tokens",
                  "steps", "preemptions", "finished"):
        assert getattr(s, field) == getattr(r, field), field
    check_idle(e)


# ---- abort mid-run: the event-driven engines do what the reference does ----------------------

def twin(fast_make, ref_make, reqs, t_abort, pick, planned=True, after=None):
    """Run ``fast`` and the reference side by side to ``t_abort`` (mid-step), abort the request
    ``pick(fast)`` chooses in both (``after(fast, handles)`` runs right after), run both to the
    end; returns (fast, ref, handles, id)."""
    fast, ref = fast_make(), ref_make()
    hs = {r[0]: fast.submit(*r) for r in reqs}
    for r in reqs:
        ref.submit(*r)
    done_f = list(fast.advance_to(t_abort))
    done_r = list(ref.advance_to(t_abort))
    assert_close(outcome(done_f), outcome(done_r))
    assert fast.now_s == pytest.approx(ref.now_s, rel=1e-12)
    if planned:
        fast.next_event_time()
        ref.next_event_time()
    i = pick(fast)
    running, waiting = fast.num_running, fast.num_waiting
    was_running = hs[i].tag != 0 if isinstance(fast, DecodeEngine) else any(
        x is hs[i] for x in fast._running)
    energy = fast.energy_j()
    tokens = fast.tokens_out(hs[i])
    assert fast.abort(hs[i]) and ref.abort(ref.requests[i])
    # its batch slot or queue place goes at once (a slot may be taken again at once when
    # the step at the clock is planned again); nothing else moves at the abort
    assert fast.num_running + fast.num_waiting == running + waiting - 1
    if was_running and not isinstance(fast, DecodeEngine):
        assert fast.num_running == running - 1       # plans are made when stepping
    assert fast.energy_j() == energy and fast.tokens_out(hs[i]) == tokens
    assert not fast.abort(hs[i]) and not ref.abort(ref.requests[i])
    if after is not None:
        after(fast, hs)
    got_f = done_f + list(fast.run_until_idle())
    got_r = done_r + list(ref.run_until_idle())
    assert i not in {r.req_id for r in got_f} | {r.req_id for r in got_r}
    assert sorted(r.req_id for r in got_f) == sorted(r[0] for r in reqs if r[0] != i)
    assert_close(outcome(got_f), outcome(got_r))
    assert hs[i].finish_s is None and fast.tokens_out(hs[i]) == tokens
    assert fast.energy_j() >= energy
    fast.advance_to(ref.now_s)
    ref.advance_to(fast.now_s)
    s, r = fast.stats(), ref.stats()
    for field in ("prefill_tokens", "decode_tokens", "steps", "preemptions", "finished"):
        assert getattr(s, field) == getattr(r, field), field
    for field in ("busy_s", "swap_s", "energy_j"):
        assert getattr(s, field) == pytest.approx(getattr(r, field), rel=1e-9), field
    # the aborted request keeps its share of the steps it was in: the shares add up
    assert sum(h.energy_j for h in hs.values()) == pytest.approx(fast.step_energy_j, rel=1e-9)
    check_idle(fast)
    check_idle(ref)
    return fast, ref, hs, i


def step_times(ref_make, reqs):
    """Start and end of every step of the reference engine stepped one step at a time, with
    (running, waiting) at its start."""
    e = ref_make()
    for r in reqs:
        e.submit(*r)
    out = []
    while not e.idle:
        t0 = e.now_s
        t1 = e.next_event_time()
        run = e._step_run
        victims = bool(run is not None and run.plan is not None and run.plan.victims)
        out.append((t0, t1, e.num_running, victims))
        e.advance_to(t1)
    return out


def decode_pair(kv=2048, max_batch=8):
    cost = affine(kv)
    return (lambda: DecodeEngine(cost, max_batch=max_batch, max_batched_tokens=512),
            lambda: Engine(cost, mode="decode", max_batch=max_batch, max_batched_tokens=512,
                           exact=True))


def prefill_pair():
    cost = affine(1 << 16)
    return (lambda: PrefillEngine(cost, max_batch=4, max_batched_tokens=1024),
            lambda: Engine(cost, mode="prefill", max_batch=4, max_batched_tokens=1024,
                           exact=True))


def running_longest(e) -> int:
    """The running request with the most left to do."""
    if isinstance(e, DecodeEngine):
        return max(e._running.values(), key=lambda r: r.output_tokens - r.g - e.D).req_id
    return max(e._running, key=lambda r: r.left).req_id


def waiting_head(e) -> int:
    return e._waiting[0].req_id


def waiting_tail(e) -> int:
    return e._waiting[-1].req_id


@pytest.mark.parametrize("planned", [False, True], ids=["unplanned", "planned"])
@pytest.mark.parametrize("what", ["running", "waiting-head", "waiting-tail"])
def test_decode_abort_mid_run_matches_the_reference(what, planned):
    fast_make, ref_make = decode_pair()
    reqs = requests(21, 120, 0.02, prompt=(16, 400), output=(2, 300))
    steps = step_times(ref_make, reqs)
    assert any(v for *_, v in steps)                     # the small KV cache preempts
    pick = {"running": running_longest, "waiting-head": waiting_head,
            "waiting-tail": waiting_tail}[what]
    tried = 0
    for k in range(len(steps) // 5, len(steps), max(1, len(steps) // 12)):
        t0, t1, *_ = steps[k]
        probe = fast_make()
        for r in reqs:
            probe.submit(*r)
        probe.advance_to((t0 + t1) / 2)
        if (what == "running" and probe.num_running < 2) or \
                (what != "running" and len(probe._waiting) < 2):
            continue
        twin(fast_make, ref_make, reqs, (t0 + t1) / 2, pick, planned)
        tried += 1
    assert tried >= 3


def test_decode_abort_when_the_next_run_is_planned_but_not_started():
    """The clock at the end of a run (``max_run_steps``) and the next one planned, with no
    admission: aborting a running request prices the run again for the smaller batch."""
    cost = affine(1 << 16)
    def fast_make():
        return DecodeEngine(cost, max_batch=8, max_run_steps=4)

    def ref_make():
        return Engine(cost, mode="decode", max_batch=8, exact=True)

    reqs = [("a", 0.0, 300, 40), ("b", 0.0, 200, 30), ("c", 0.0, 100, 35)]
    t0, t1, *_ = step_times(ref_make, reqs)[3]           # the last step of the first run

    def planned_run(fast, hs):
        run = fast._step_run
        assert run is not None and run.done == 0 and run.undo is None and fast.n == 2

    probe = fast_make()
    for r in reqs:
        probe.submit(*r)
    probe.advance_to((t0 + t1) / 2)
    probe.next_event_time()
    assert probe._step_run.done == 0 and probe._step_run.undo is None and probe.D == 4
    twin(fast_make, ref_make, reqs, (t0 + t1) / 2, lambda e: "b", after=planned_run)


def test_decode_abort_takes_back_a_planned_preemption():
    """The step at the clock was planned with a preemption (planned, not run): aborting a
    running request undoes the preemption and plans the step again, as the reference does."""
    fast_make, ref_make = decode_pair(kv=1536)
    reqs = requests(22, 100, 0.01, prompt=(16, 400), output=(50, 400))
    steps = step_times(ref_make, reqs)
    hits = 0
    for k in range(1, len(steps)):
        if not steps[k][3]:
            continue
        t0, t1 = steps[k - 1][:2]                      # the step before the preempting one
        probe = fast_make()
        for r in reqs:
            probe.submit(*r)
        probe.advance_to((t0 + t1) / 2)
        probe.next_event_time()
        run = probe._step_run
        assert run is not None and run.done == 0 and run.undo[2], k
        victims = [v.req_id for v in run.undo[2]]
        oldest = next(iter(probe._running.values())).req_id
        n_pre = probe.preemptions

        def undone(fast, hs, keep=victims, victims=victims, n_pre=n_pre):
            # right after the abort the step at the clock is planned again, from the state
            # before its preemption: the victims' preemptions were taken back (the aborted
            # one's too: it never happened), those preempted again are counted again
            run = fast._step_run
            assert run is not None and run.done == 0
            again = [] if run.undo is None or run.undo[2] is None else run.undo[2]
            assert fast.preemptions == n_pre - len(victims) + len(again)
            assert all(hs[v].tag for v in keep if hs[v] not in again)

        twin(fast_make, ref_make, reqs, (t0 + t1) / 2, lambda e, i=oldest: i, after=undone)
        # abort a victim instead: the others come back, it stays out
        twin(fast_make, ref_make, reqs, (t0 + t1) / 2, lambda e, i=victims[0]: i,
             after=lambda f, hs, u=undone, keep=victims[1:]: u(f, hs, keep))
        hits += 1
        if hits == 3:
            break
    assert hits >= 1


@pytest.mark.parametrize("what", ["running", "waiting-head", "waiting-tail"])
def test_prefill_abort_mid_prefill_matches_the_reference(what):
    fast_make, ref_make = prefill_pair()
    reqs = requests(23, 80, 0.004, prompt=(16, 3000), output=(1, 2))
    steps = step_times(ref_make, reqs)
    pick = {"running": running_longest, "waiting-head": waiting_head,
            "waiting-tail": waiting_tail}[what]
    tried = 0
    for k in range(2, len(steps), max(1, len(steps) // 15)):
        t0, t1, *_ = steps[k]
        probe = fast_make()
        for r in reqs:
            probe.submit(*r)
        probe.advance_to((t0 + t1) / 2)
        probe.next_event_time()
        if what == "running":
            r = max(probe._running, key=lambda x: x.left, default=None)
            if r is None or r.done_tokens == 0:         # mid-prefill: a chunk done, more left
                continue
        elif len(probe._waiting) < 2:
            continue
        twin(fast_make, ref_make, reqs, (t0 + t1) / 2, pick)
        tried += 1
    assert tried >= 3


def test_mixed_engine_fast_runs_abort_like_the_exact_one():
    cost = affine(4096)
    reqs = requests(24, 80, 0.02, prompt=(16, 600), output=(2, 300))
    def fast_make():
        return Engine(cost, max_batch=8, max_batched_tokens=512)

    def ref_make():
        return Engine(cost, max_batch=8, max_batched_tokens=512, exact=True)

    steps = step_times(ref_make, reqs)
    tried = 0
    for k in range(len(steps) // 6, len(steps), max(1, len(steps) // 8)):
        t0, t1, n, _ = steps[k]
        if n < 2:
            continue
        fast, ref = fast_make(), ref_make()
        for e in (fast, ref):
            for r in reqs:
                e.submit(*r)
            e.advance_to((t0 + t1) / 2)
        i = max(fast._running, key=lambda x: x.output_tokens - x.generated_tokens).req_id
        for e in (fast, ref):
            assert e.abort(e.requests[i])
            e.run_until_idle()
        want = outcome(ref.finished)
        got = outcome(fast.finished)
        assert set(got) == set(want) and i not in got
        for key in got:
            assert got[key][1] == pytest.approx(want[key][1], rel=1e-9), key
        check_idle(fast)
        tried += 1
    assert tried >= 3


# ---- what an abort frees -----------------------------------------------------------------------

def test_decode_abort_frees_the_slot_and_finishes_the_others_no_later():
    """A full batch of identical requests and a queue behind it: aborting one mid-decode
    admits the head of the queue at once; every other request finishes no later than without
    the abort, the queued ones earlier."""
    cost = affine(1 << 16)
    reqs = [(i, 0.0, 200, 300) for i in range(8)]
    base = DecodeEngine(cost, max_batch=4)
    hb = [base.submit(*r) for r in reqs]
    base.run_until_idle()
    e = DecodeEngine(cost, max_batch=4)
    hs = [e.submit(*r) for r in reqs]
    e.advance_to(hb[0].finish_s / 3)
    e.next_event_time()
    assert e.num_running == 4 and e.num_waiting == 4
    used = e.kv_capacity_tokens - e.free_kv_tokens
    blocks = -(-(hs[1].o + e.D) // e.bt)
    assert e.abort(hs[1])
    assert e.num_running == 3 and e.num_waiting == 4          # at once
    assert e.kv_capacity_tokens - e.free_kv_tokens == used - blocks * e.bt
    e.next_event_time()                                       # the step at the clock
    assert e.num_running == 4 and e.num_waiting == 3          # the head took the slot
    e.run_until_idle()
    check_idle(e)
    for h, b in zip(hs, hb):
        if h is hs[1]:
            assert h.finish_s is None
            continue
        assert h.finish_s <= b.finish_s * (1 + 1e-12), h.req_id
    assert hs[4].finish_s < hb[4].finish_s
    assert e.decode_tokens < base.decode_tokens


def test_prefill_abort_gives_back_the_prompt_blocks():
    cost = affine(1 << 14)
    e = PrefillEngine(cost, max_batch=4, max_batched_tokens=1024)
    a = e.submit("a", 0.0, 6000)
    b = e.submit("b", 0.0, 9000)                  # does not fit next to a: waits
    c = e.submit("c", 0.0, 100)
    e.advance_to(e.next_event_time())              # a's first chunk
    assert e.num_running == 1 and a.done_tokens == 1024 and e.num_waiting == 2
    assert e.free_kv_tokens == e.kv_capacity_tokens - 6000
    assert e.abort(a)
    assert e.num_running == 0 and e.free_kv_tokens == e.kv_capacity_tokens
    got = e.run_until_idle()
    assert [r.req_id for r in got] == ["b", "c"] and a.finish_s is None
    assert e.prefill_tokens == 1024 + 9000 + 100 and e.tokens_out(a) == 0
    assert a.energy_j > 0 and a.energy_j + b.energy_j + c.energy_j == pytest.approx(
        e.step_energy_j)
    check_idle(e)


def test_decode_abort_of_a_request_whose_kv_is_still_in_flight():
    """Not arrived yet (a KV transfer in flight): it leaves the arrival heap; a decode run
    it had cut short (it would have joined) is planned again to the next event."""
    cost = affine(1 << 16)
    e = DecodeEngine(cost, max_batch=8)
    a = e.submit("a", 0.0, 100, 50)
    late = e.submit("late", 0.05, 100, 50)
    t_cut = e.next_event_time()
    assert e.num_waiting == 1 and t_cut < a.output_tokens * 0.01
    assert e.abort(late) and e.num_waiting == 0
    assert e.next_event_time() > t_cut                 # a's run goes on to its finish
    (got,) = e.run_until_idle()
    ref = DecodeEngine(cost, max_batch=8)
    ra = ref.submit("a", 0.0, 100, 50)
    ref.run_until_idle()
    assert got is a and a.finish_s == ra.finish_s and late.finish_s is None
    assert e.tokens_out(late) == 1                    # the one it came with


def test_abort_refuses_finished_foreign_and_aborted_requests():
    cost = affine(4096)
    for make in (lambda: DecodeEngine(cost), lambda: PrefillEngine(cost),
                 lambda: Engine(cost, mode="decode"), lambda: Engine(cost)):
        e, other = make(), make()
        a = e.submit("a", 0.0, 50, 3)
        x = other.submit("a", 0.0, 50, 3)
        assert not e.abort(x)                        # another engine's record
        e.run_until_idle()
        assert a.finished and not e.abort(a)
        b = e.submit("b", e.now_s + 1.0, 50, 3)
        assert e.abort(b) and not e.abort(b) and e.idle
        assert e.run_until_idle() == [] and e.stats().finished == 1


def test_vpod_engines_abort_in_the_engine_that_holds_it():
    cost = affine(4096)
    ve = VPodEngines([DecodeEngine(cost, max_batch=4) for _ in range(2)])
    hs = [ve.submit(i, 0.0, 100, 200) for i in range(4)]
    assert ve.loads == [2, 2]
    ve.advance_to(0.05)
    assert ve.num_running == 4
    assert ve.abort(hs[1]) and ve.loads == [2, 1] and ve.num_running == 3
    assert not ve.abort(hs[1]) and ve.loads == [2, 1]
    ve.submit(9, ve.now_s, 100, 10)                    # goes to the lighter engine
    assert ve.loads == [2, 2] and ve.engines[1].num_waiting == 1
    done = []
    while not ve.idle:
        done += ve.advance_to(ve.next_event_time())
    assert sorted(x.req_id for x in done) == [0, 2, 3, 9] and ve.loads == [0, 0]
    assert all(e.free_kv_tokens == e.kv_capacity_tokens for e in ve.engines)


def test_every_engine_has_abort_in_the_protocol():
    for name, (make, side) in ENGINES.items():
        e = make(cost_for(side))
        assert isinstance(e, SimEngine) and callable(e.abort), name
    assert "abort" in SimEngine.__dict__
