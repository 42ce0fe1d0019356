"""The tabulated step-cost model against the detailed chip model it was built from."""
import numpy as np
import pytest

from dse import default_catalog, load_model
from dse.costmodel import Parallelism
from dse.vpod import ICITopology
from sim.chip import ChipModel
from sim.stepcost import StepCostTable

CAT = default_catalog()


def table(model, chip, topo, par):
    c = CAT.get(chip)
    return StepCostTable(ChipModel(load_model(model), c, ICITopology.parse(topo).for_chip(c), par))


@pytest.mark.parametrize("args", [("llama3-8b", "v6e", "1x1", Parallelism(1)),
                                  ("deepseek-v3", "v5p", "4x4x2", Parallelism(4, 1, 8))])
def test_fit_error_against_detailed_model(args):
    err = table(*args).fit_error(150, seed=1)
    assert err["latency_mean_rel_err"] < 0.01 and err["latency_max_rel_err"] < 0.05
    assert err["energy_mean_rel_err"] < 0.01 and err["energy_max_rel_err"] < 0.05


def test_exact_on_grid_points_and_matches_chip_model_steps():
    tab = table("llama3-70b", "v5p", "2x2x2", Parallelism(8))
    cm = tab.model
    for b, L in ((8, 256), (64, 4096)):
        lat, en = tab.step(0, 0, b, b * L)
        r = cm.mixed_step(0, 0, b, b * L)
        assert float(lat) == pytest.approx(r.latency_s, rel=1e-6)
        assert float(en) == pytest.approx(r.energy_j, rel=1e-6)
    # and a prefill step of 4 prompts of 1024 tokens equals ChipModel.step's TTFT (pp = 1)
    lat, _ = tab.step(4096, 4 * 1024 * 1025 / 2, 0, 0)
    assert float(lat) == pytest.approx(cm.step("prefill", 4, 1024).latency_s, rel=0.02)


def test_vectorised_and_protocol_fields():
    tab = table("llama3-8b", "v6e", "1x1", Parallelism(1))
    kv = 32 * 1000 + 32 * np.arange(1000)
    lat, en = tab.step(0, 0, 32, kv)
    assert lat.shape == en.shape == (1000,)
    assert np.all(np.diff(lat) >= 0)           # longer KV never makes a step faster
    assert tab.num_chips == 1 and tab.static_power_w > 0
    # KV capacity: 90 % of 32 GB minus 16 GB of weights, at 128 KiB per token
    assert tab.kv_capacity_tokens == pytest.approx((0.9 * 32e9 - 16.06e9) / 131072, rel=0.01)
    assert tab.kv_bytes_per_token == 131072
