"""``tokens_out(request, t)`` of the event-driven engines (what a wall-clock driver streams):
the number of a request's output tokens that exist at time ``t`` after ``advance_to(t)``,
checked against the reference engine stepped one step at a time, which records when each token
of each request appears."""
from __future__ import annotations

from bisect import bisect_right

import numpy as np
import pytest

from engine_cases import affine, chip_table, workload
from sim.engine import Engine
from sim.fastengine import DecodeEngine, PrefillEngine


def token_times(mode: str, cost, reqs, max_batch: int) -> dict[int, list[float]]:
    """Per request, the time each output token exists (reference engine, exact steps). In
    decode mode the first token comes with the request (at its arrival)."""
    ref = Engine(cost, mode=mode, max_batch=max_batch, exact=True)
    for r in reqs:
        ref.submit(*r)
    times = {rid: ([t] if mode == "decode" else []) for rid, t, _, _ in reqs}
    while not ref.idle:
        t = ref.next_event_time()
        ref.advance_to(t)
        for rid, r in ref.requests.items():
            while len(times[rid]) < r.generated_tokens:
                times[rid].append(ref.now_s)
    return times


def between(times: list[float], t: float, rtol: float) -> tuple[int, int]:
    """Tokens that exist at ``t``, allowing the engines' times to differ by ``rtol``."""
    return bisect_right(times, t * (1 - rtol)), bisect_right(times, t * (1 + rtol) + 1e-12)


def check_progress(cls, mode, cost, reqs, max_batch, probes, rtol=0.0):
    truth = token_times(mode, cost, reqs, max_batch)
    eng = cls(cost, max_batch=max_batch)
    recs = {}
    i = 0
    seen_partial = False
    for t in probes:
        while i < len(reqs) and reqs[i][1] <= t:
            recs[reqs[i][0]] = eng.submit(*reqs[i])
            i += 1
        eng.advance_to(t)
        for rid, rec in recs.items():
            lo, hi = between(truth[rid], t, rtol)
            assert lo <= eng.tokens_out(rec, t) <= hi, (rid, t)
            seen_partial |= 0 < lo < rec.output_tokens
        # without a time: the count at the engine's clock (the step in progress included)
        for rid, rec in recs.items():
            lo, hi = between(truth[rid], eng.now_s, rtol + 1e-9)
            assert lo <= eng.tokens_out(rec) <= hi, rid
    return seen_partial


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_tokens_out_matches_the_reference_step_by_step(seed):
    reqs = workload(seed, 60, 0.02, prompt=(16, 300), output=(1, 120))
    probes = np.sort(np.random.default_rng(seed).uniform(0, 3.0, 400))
    assert check_progress(DecodeEngine, "decode", affine(1 << 20), reqs, 16, probes)


def test_decode_tokens_out_on_the_chip_model_table():
    reqs = workload(3, 40, 0.03, prompt=(16, 300), output=(1, 80))
    probes = np.sort(np.random.default_rng(3).uniform(0, 2.5, 200))
    # the chip model's table is linearised over runs of steps: times agree to ~1e-4
    assert check_progress(DecodeEngine, "decode", chip_table(), reqs, 8, probes, rtol=1e-4)


def test_prefill_tokens_out_is_one_once_the_first_token_exists():
    reqs = workload(2, 60, 0.01, prompt=(16, 3000), output=(1, 2))
    probes = np.sort(np.random.default_rng(2).uniform(0, 1.5, 300))
    check_progress(PrefillEngine, "prefill", affine(1 << 20), reqs, 8, probes)


def test_decode_tokens_out_of_a_future_arrival_and_a_lone_request():
    cost = affine(1 << 20)
    eng = DecodeEngine(cost, max_batch=4)
    r = eng.submit("a", 1.0, 100, 5)
    eng.advance_to(0.5)
    assert eng.tokens_out(r, 0.5) == 1          # the first token came with it (not yet here)
    lat = cost.step(0.0, 0.0, 1.0, 101.0)[0]
    eng.advance_to(1.0 + 0.5 * lat)             # its first decode step is in progress
    assert eng.tokens_out(r, 1.0 + 0.5 * lat) == 1
    assert eng.tokens_out(r) == 2               # ... and done at the engine's clock
    eng.run_until_idle()
    assert eng.tokens_out(r) == 5 and r.finish_s is not None
