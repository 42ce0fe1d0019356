"""The engine on the real step-cost table (chip model) rather than the affine test model."""
import numpy as np
import pytest

from engine_cases import chip_table
from sim.engine import Engine


@pytest.fixture(scope="module")
def table():
    return chip_table()


def run(table, exact, capacity=None, n=150, seed=0):
    if capacity is not None:
        table.kv_capacity_tokens = capacity
    rng = np.random.default_rng(seed)
    e = Engine(table, mode="mixed", max_batch=64, max_batched_tokens=4096, exact=exact)
    t = 0.0
    for i in range(n):
        t += rng.exponential(0.05)
        e.submit(i, t, int(rng.integers(50, 2000)), int(rng.integers(2, 400)))
    e.run_until_idle()
    return e


def test_fast_and_exact_agree_on_the_chip_model_with_swapping(table):
    full = table.kv_capacity_tokens
    try:
        fast, exact = run(table, False, 30000), run(table, True, 30000)
    finally:
        table.kv_capacity_tokens = full
    assert exact.stats().preemptions > 0
    assert fast.stats().preemptions == exact.stats().preemptions
    for rid, r in exact.requests.items():
        f = fast.requests[rid]
        assert f.finish_s == pytest.approx(r.finish_s, rel=1e-3)
        assert f.ttft_s == pytest.approx(r.ttft_s, rel=1e-3, abs=1e-9)
    assert fast.stats().energy_j == pytest.approx(exact.stats().energy_j, rel=1e-3)
    assert fast.stats().cost_calls < exact.stats().cost_calls / 3
    # nothing lost: every request produced every token
    assert all(r.generated_tokens == r.output_tokens for r in fast.requests.values())


def test_energy_and_chip_seconds_accounting(table):
    e = run(table, False, n=40)
    st = e.stats()
    assert st.chip_s == pytest.approx(st.elapsed_s * table.num_chips)
    # energy at least static power over the whole time, at most peak power over busy time + idle
    assert st.energy_j >= table.static_power_w * st.elapsed_s * 0.999
    peak_w = table.model.chip.peak_flops_per_s / table.model.chip.max_flop_per_j
    assert st.energy_j <= peak_w * 1.5 * st.busy_s + table.static_power_w * st.idle_s
