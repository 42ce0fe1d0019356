"""The event-driven prefill/decode engines (sim/fastengine.py) against the reference engine
(sim/engine.py, one step per iteration) in the same mode: same schedule, same times, same
energy, on the affine test model and on the chip model's step-cost table."""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine_cases import affine, chip_table, workload
from sim.engine import Engine
from sim.fastengine import DecodeEngine, PrefillEngine
from sim.stepcost import PipelineShare


@pytest.fixture(scope="module")
def table():
    return chip_table()


def compare(ref: Engine, fast, reqs, fast_reqs, rtol):
    for (i, *_), fr in zip(reqs, fast_reqs):
        rr = ref.requests[i]
        assert fr.finish_s == pytest.approx(rr.finish_s, rel=rtol, abs=1e-9), i
        assert fr.first_token_s == pytest.approx(rr.first_token_s, rel=rtol, abs=1e-9), i
        assert fr.preemptions == rr.preemptions
    assert fast.energy_j() == pytest.approx(ref.stats().energy_j, rel=rtol)
    assert fast.steps == ref.stats().steps


def run_pair(mode, cost, reqs, max_batch, mbt, step_s=None):
    ref = Engine(cost, mode=mode, max_batch=max_batch, max_batched_tokens=mbt, exact=True)
    cls = DecodeEngine if mode == "decode" else PrefillEngine
    fast = cls(cost, max_batch=max_batch, max_batched_tokens=mbt)
    for r in reqs:
        ref.submit(*r)
    ref.run_until_idle()
    got, handles = [], []
    if step_s is None:                          # everything submitted up front
        handles = [fast.submit(*r) for r in reqs]
        got = fast.run_until_idle()
    else:                                       # just-in-time submission, small advances
        i, t = 0, 0.0
        while len(got) < len(reqs):
            t += step_s
            while i < len(reqs) and reqs[i][1] <= t:
                handles.append(fast.submit(*reqs[i]))
                i += 1
            got += fast.advance_to(t)
    assert sorted(r.req_id for r in got) == [r[0] for r in reqs]
    ref.advance_to(fast.now_s)                  # same horizon for the idle energy
    fast.advance_to(ref.now_s)
    return ref, fast, handles


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("step_s", [None, 0.0137])
def test_decode_engine_matches_the_reference_with_preemption(seed, step_s):
    reqs = workload(seed, 200, 0.05)
    ref, fast, handles = run_pair("decode", affine(4096), reqs, 32, 512, step_s)
    assert ref.stats().preemptions > 20             # the small KV cache forces swapping
    assert fast.preemptions == ref.stats().preemptions
    compare(ref, fast, reqs, handles, 1e-9)
    assert fast.cost_calls * 10 < ref.stats().cost_calls


@pytest.mark.parametrize("step_s", [None, 0.5])
def test_prefill_engine_matches_the_reference(step_s):
    reqs = workload(3, 300, 0.004, prompt=(16, 3000))
    ref, fast, handles = run_pair("prefill", affine(1 << 16), reqs, 16, 2048, step_s)
    compare(ref, fast, reqs, handles, 1e-12)
    # chunked: some requests took several steps, some steps held several requests
    assert ref.stats().steps < len(reqs) * 2


def test_decode_engine_on_the_chip_model_table(table):
    full = table.kv_capacity_tokens
    table.kv_capacity_tokens = 60000
    try:
        reqs = workload(5, 300, 0.01, prompt=(50, 3000), output=(1, 600))
        ref, fast, handles = run_pair("decode", table, reqs, 128, 8192, 0.25)
    finally:
        table.kv_capacity_tokens = full
    assert ref.stats().preemptions > 0
    # the table is log-log interpolated: a run's linearised latency is within 1e-4
    compare(ref, fast, reqs, handles, 1e-4)
    tpot_ref = np.array([ref.requests[i].tpot_s or 0 for i, *_ in reqs])
    tpot = np.array([h.tpot_s or 0 for h in handles])
    np.testing.assert_allclose(tpot, tpot_ref, rtol=1e-4)


def test_pipeline_share_and_a_single_long_request(table):
    share = PipelineShare(table, 4)
    fast = DecodeEngine(share, max_batch=8, max_run_steps=64)
    ref = Engine(share, mode="decode", max_batch=8, exact=True)
    for e in (fast, ref):
        e.submit("a", 0.0, 1000, 3000)
    h = fast.submit("b", 0.2, 10, 2)
    ref.submit("b", 0.2, 10, 2)
    ref.run_until_idle()
    got = fast.run_until_idle()
    assert {r.req_id for r in got} == {"a", "b"}
    assert h.finish_s == pytest.approx(ref.requests["b"].finish_s, rel=1e-5)
    assert fast.steps == ref.stats().steps == 2999
    assert fast.energy_j() == pytest.approx(ref.stats().energy_j, rel=1e-5)
    assert math.isclose(fast.now_s, ref.now_s, rel_tol=1e-5)


def test_refuses_requests_larger_than_the_kv_cache():
    e = DecodeEngine(affine(1024))
    with pytest.raises(ValueError, match="more than the vPod"):
        e.submit(0, 0.0, 1000, 100)
    p = PrefillEngine(affine(1024))
    with pytest.raises(ValueError, match="more than the vPod"):
        p.submit(0, 0.0, 2000)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_step_energy_is_shared_out_to_the_requests(mode, table):
    reqs = workload(2, 300, 0.01, prompt=(50, 3000), output=(1, 300))
    cls = DecodeEngine if mode == "decode" else PrefillEngine
    full = table.kv_capacity_tokens
    table.kv_capacity_tokens = 60000           # some swapping in decode
    try:
        e = cls(table, max_batch=64)
        hs = [e.submit(*r) for r in reqs]
        e.run_until_idle()
    finally:
        table.kv_capacity_tokens = full
    assert all(h.energy_j > 0 for h in hs if mode == "prefill" or h.output_tokens > 1)
    assert sum(h.energy_j for h in hs) == pytest.approx(e.step_energy_j, rel=1e-9)
    # longer prompts (prefill) / more output tokens (decode) take a larger share
    size = [h.prompt_tokens if mode == "prefill" else h.output_tokens for h in hs]
    assert np.corrcoef(size, [h.energy_j for h in hs])[0, 1] > 0.8


@pytest.mark.parametrize("fits", [True, False])
def test_the_chip_models_kv_fit_is_what_the_decode_engine_admits(fits):
    """``ChipModel.holds(batch, length)`` - the policy's test that an allocation's batch fits
    at a bucket's length - agrees with the simulated engine's KV blocks: a batch that holds
    runs all at once; one that does not never does (the engine admits what its KV takes)."""
    from dse import default_catalog, load_model
    from dse.costmodel import Parallelism
    from dse.vpod import ICITopology
    from sim.chip import ChipModel
    from sim.stepcost import StepCostTable
    cm = ChipModel(load_model("llama3-8b"), default_catalog().get("v6e"),
                   ICITopology.parse("1x1"), Parallelism(1))
    batch, out = 64, 8
    cap = cm.kv_capacity_tokens()
    # the longest sequences that hold (with a block's rounding to spare), or 10 % too long
    length = (cap // batch - 32) if fits else int(1.1 * cap / batch)
    assert cm.holds(batch, length) is fits
    e = DecodeEngine(StepCostTable(cm), max_batch=batch)
    for k in range(batch):
        e.submit(k, 0.0, length - out, out)
    most, t, done = 0, 0.0, []
    while len(done) < batch:
        t += 1e-3
        done += e.advance_to(t)
        most = max(most, e.n)
    assert (most == batch) is fits
