"""The one engine protocol (:class:`sim.engine.SimEngine`) on all three engines: its members,
the stats and KV facts, and the exactness of ``next_event_time()``: an engine driven only by
``t = next_event_time(); advance_to(t)`` finishes every request at the same time, bit for bit,
as when it is driven by fixed time slices or by ``run_until_idle()``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine_cases import affine, chip_table
from engine_cases import workload as requests
from sim.engine import Engine, EngineStats, SimEngine
from sim.fastengine import DecodeEngine, PrefillEngine


@pytest.fixture(scope="module")
def table():
    t = chip_table()
    t.kv_capacity_tokens = 30000                # small: the decode engines swap
    return t


# name -> (factory, prefill side?); small batches and KV caches: admission waits, preemptions
ENGINES = {
    "mixed": (lambda c: Engine(c, max_batch=32, max_batched_tokens=512), False),
    "mixed-exact": (lambda c: Engine(c, max_batch=32, max_batched_tokens=512, exact=True),
                    False),
    "mixed-short-runs": (lambda c: Engine(c, max_batch=16, max_batched_tokens=256,
                                          max_run_steps=7), False),
    "prefill-mode": (lambda c: Engine(c, mode="prefill", max_batch=16,
                                      max_batched_tokens=2048), True),
    "decode-mode": (lambda c: Engine(c, mode="decode", max_batch=32,
                                     max_batched_tokens=512), False),
    "PrefillEngine": (lambda c: PrefillEngine(c, max_batch=16, max_batched_tokens=2048), True),
    "DecodeEngine": (lambda c: DecodeEngine(c, max_batch=32, max_batched_tokens=512), False),
    "DecodeEngine-short-runs": (lambda c: DecodeEngine(c, max_batch=64, max_batched_tokens=4096,
                                                       max_run_steps=5), False),
}


def workload(seed: int, prefill_side: bool, n: int = 160) -> list[tuple[int, float, int, int]]:
    if prefill_side:
        return requests(seed, n, 0.004, prompt=(16, 3000), output=(1, 2))
    return requests(seed, n, 0.02, prompt=(16, 1500), output=(1, 400))


def up_front(e: SimEngine, reqs) -> list:
    for r in reqs:
        e.submit(*r)
    return list(e.run_until_idle())


def slices(e: SimEngine, reqs, dt_s: float) -> list:
    """A wall-clock server's loop: every ``dt_s``, submit what has arrived, then advance."""
    got, i, t = [], 0, 0.0
    while i < len(reqs) or not e.idle:
        t += dt_s
        while i < len(reqs) and reqs[i][1] <= t:
            e.submit(*reqs[i])
            i += 1
        got += e.advance_to(t)
    return got


def events(e: SimEngine, reqs, seed: int) -> list:
    """Only ``t = next_event_time(); advance_to(t)``. Requests are submitted before the engine
    reaches their arrival, at arbitrary earlier moments (some well ahead of time)."""
    rng = np.random.default_rng(seed)
    got, i, calls = [], 0, 0
    while True:
        t = e.next_event_time()
        # submit every request arriving by t, and now and then a few more ahead of time
        while i < len(reqs) and (t is None or reqs[i][1] <= t or rng.random() < 0.1):
            e.submit(*reqs[i])
            i += 1
            t = e.next_event_time()
        if t is None:
            break
        before = e.now_s
        done = e.advance_to(t)
        calls += 1
        # progress: the clock moved to exactly t, or finished requests were returned
        assert e.now_s == t and (t > before or done), (before, t, done)
        for r in done:          # no finish skipped: each is returned at its own event time
            assert r.finish_s == t or r.finish_s == r.arrival_s <= t, (r, t)
        got += done
    # every call ran a step or more, reached an arrival or returned a finish
    assert i == len(reqs) and e.idle and calls <= e.stats().steps + 2 * len(reqs)
    return got


def outcome(e: SimEngine, got) -> dict:
    assert sorted(r.req_id for r in got) == sorted(set(r.req_id for r in got))
    return {r.req_id: (r.first_token_s, r.finish_s, r.preemptions) for r in got}


@pytest.mark.parametrize("cost_name", ["affine", "table"])
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_next_event_time_driving_is_exact(name, cost_name, table):
    make, prefill_side = ENGINES[name]
    cost = affine(4096 if not prefill_side else 1 << 16) if cost_name == "affine" else table
    reqs = workload(sorted(ENGINES).index(name), prefill_side)
    ref = make(cost)
    want = outcome(ref, up_front(ref, reqs))
    assert len(want) == len(reqs)
    runs = {"slices 13.7 ms": (lambda e: slices(e, reqs, 0.0137)),
            "slices 0.5 s": (lambda e: slices(e, reqs, 0.5)),
            "events": (lambda e: events(e, reqs, 1)),
            "events, other submission times": (lambda e: events(e, reqs, 2))}
    for how, drive in runs.items():
        e = make(cost)
        got = outcome(e, drive(e))
        assert got == want, how                                # bit for bit
        s, r = e.stats(), ref.stats()
        assert (s.steps, s.preemptions, s.finished) == (r.steps, r.preemptions, r.finished)
        ref.advance_to(e.now_s)                  # same horizon for the idle energy
        e.advance_to(ref.now_s)
        assert e.energy_j() == pytest.approx(ref.energy_j(), rel=1e-12)
    if not prefill_side and cost_name == "affine":
        assert ref.stats().preemptions > 0      # the small KV cache makes the case hard


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_satisfies_the_protocol(name):
    make, prefill_side = ENGINES[name]
    cost = affine(4010)                          # not a multiple of the 16-token block
    e = make(cost)
    assert isinstance(e, SimEngine)
    assert e.kv_capacity_tokens == e.free_kv_tokens == 4000
    assert e.idle and e.num_running == e.num_waiting == 0 and e.next_event_time() is None
    reqs = workload(7, prefill_side, n=40)
    for r in reqs:
        e.submit(*r)
    assert not e.idle and e.num_waiting == len(reqs)
    assert e.next_event_time() == reqs[0][1]
    done = list(e.advance_to(reqs[10][1]))
    while e.num_running == 0:
        done += e.advance_to(e.next_event_time())
    assert 0 <= e.free_kv_tokens < e.kv_capacity_tokens       # KV in use
    done += e.run_until_idle()
    assert e.idle and e.free_kv_tokens == e.kv_capacity_tokens
    st = e.stats()
    assert isinstance(st, EngineStats)
    assert st.now_s == e.now_s and st.energy_j == e.energy_j()
    assert st.finished == len(done) == len(reqs) and (st.running, st.waiting) == (0, 0)
    assert st.chip_s == pytest.approx(cost.num_chips * st.elapsed_s)
    assert st.idle_s == pytest.approx(st.elapsed_s - st.busy_s)
    assert st.energy_j > cost.static_power_w * cost.num_chips * st.elapsed_s
    assert st.steps > 0 and st.cost_calls > 0 and st.cost_points >= st.cost_calls
    assert st.iterations > 0
    if prefill_side:
        assert st.prefill_tokens == sum(p for _, _, p, _ in reqs) and st.decode_tokens == 0
    elif "Decode" in name or name == "decode-mode":
        assert st.decode_tokens == sum(o - 1 for *_, o in reqs) and st.prefill_tokens == 0


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_event_driven_engines_report_the_reference_counters(mode):
    """Same schedule as the reference engine stepped one step at a time: the same counters
    (energy and busy time to rounding)."""
    reqs = workload(4, mode == "prefill", n=120)
    cost = affine(4096 if mode == "decode" else 1 << 16)
    ref = Engine(cost, mode=mode, max_batch=32, max_batched_tokens=512, exact=True)
    fast = (DecodeEngine if mode == "decode" else PrefillEngine)(cost, max_batch=32,
                                                                 max_batched_tokens=512)
    up_front(ref, reqs)
    up_front(fast, reqs)
    r, f = ref.stats(), fast.stats()
    for field in ("now_s", "elapsed_s", "busy_s", "idle_s", "swap_s", "energy_j", "chip_s"):
        assert getattr(f, field) == pytest.approx(getattr(r, field), rel=1e-9, abs=1e-12), field
    for field in ("prefill_tokens", "decode_tokens", "steps", "preemptions", "running",
                  "waiting", "finished"):
        assert getattr(f, field) == getattr(r, field), field
    assert f.cost_calls * 5 < r.cost_calls if mode == "decode" else f.cost_calls == r.cost_calls
    if mode == "decode":
        assert r.preemptions > 0


def test_max_phase_steps_is_still_accepted():
    cost = affine(4096)
    assert Engine(cost, max_phase_steps=3).max_run_steps == 3
    assert Engine(cost, max_run_steps=5).max_run_steps == 5
    assert DecodeEngine(cost, max_phase_steps=3).max_run_steps == 3
    assert DecodeEngine(cost, max_run_steps=5).max_run_steps == 5
    with pytest.raises(ValueError, match="max_run_steps"):
        Engine(cost, max_phase_steps=0)


def test_a_request_done_on_arrival_is_an_event():
    """Decode mode, one output token: it finishes at its arrival; next_event_time() says so
    (the clock) until advance_to() has returned it."""
    for e in (Engine(affine(4096), mode="decode"), DecodeEngine(affine(4096))):
        e.submit("one", 2.0, 100, 1)
        assert e.next_event_time() == 2.0
        assert e.advance_to(2.0) == [] and e.now_s == 2.0
        assert e.next_event_time() == 2.0               # finished, not returned yet
        (r,) = e.advance_to(e.next_event_time())
        assert r.finish_s == 2.0 and e.next_event_time() is None and e.idle
        assert math.isclose(e.stats().energy_j, 2.0 * 4 * 50.0)
