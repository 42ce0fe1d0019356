import numpy as np
import pytest

from dse import NeuScaleError, default_catalog, load_model
from dse.builder import DSE, Candidate
from dse.costmodel import (Parallelism, allreduce_cost, alltoall_cost, enumerate_parallelisms,
                           group_dims, stage_layout, validate_parallelism)
from dse.vpod import ICITopology

CAT = default_catalog()


def _eval(model, chip, topo, par, phase, B, S):
    dse = DSE(load_model(model), CAT)
    dse.ensure_fits([par])
    chip = CAT.get(chip)
    return dse.evaluate(Candidate(chip, ICITopology.parse(topo).for_chip(chip), par), phase,
                        np.asarray(B), np.asarray(S))


def test_memory_feasibility_and_reasons():
    r = _eval("llama3-70b", "v5e", "1x1", Parallelism(1), "decode", [1], [1024])
    assert not r.feasible[0, 0] and r.reason[0, 0] == 0                 # weights
    r = _eval("llama3-8b", "v6e", "1x1", Parallelism(1), "decode", [1, 1024], [2048, 32768])
    assert r.feasible[0, 0]                                             # 16 GB + 0.3 GB KV
    assert not r.feasible[1, 1] and r.reason[1, 1] == 1                 # KV of 1024 x 32K
    kv = 1024 * 32768 * load_model("llama3-8b").kv_bytes_per_token()
    assert r.mem_bytes[1, 1] > kv


def test_decode_batch1_is_weight_streaming():
    """Batch-1 decode of a dense model reads every weight but the embedding once per token."""
    a = load_model("llama3-8b")
    r = _eval("llama3-8b", "v6e", "1x1", Parallelism(1), "decode", [1], [128])
    streamed = a.weight_bytes() - a.vocab * a.hidden * 2
    assert r.latency_s[0, 0] == pytest.approx(streamed / CAT.get("v6e").hbm_bw_bytes_per_s,
                                              rel=0.02)
    assert r.bound[0, 0] == 1          # memory


def test_prefill_is_compute_bound_and_energy_below_table2_peak():
    chip = CAT.get("v6e")
    r = _eval("llama3-8b", "v6e", "1x1", Parallelism(1), "prefill", [8], [4096])
    assert r.bound[0, 0] == 0
    flop_per_j = r.flops[0, 0] / r.energy_j[0, 0]
    assert 0.7 * chip.max_flop_per_j < flop_per_j <= chip.max_flop_per_j


def test_causal_attention_costs_less_than_dense_masked_count():
    a = load_model("llama3-8b")
    dse = DSE(a, CAT)
    par = Parallelism(1)
    dse.ensure_fits([par])
    fit = dse.fits.fits["attn_prefill|tp=1"]
    w = dse.cost.work(par, "prefill", np.asarray([1]), np.asarray([65536]))
    per_layer = w.stages[0].comp_flops[0][0, 0] / a.layers
    assert per_layer < fit.flops_at(1, 65536) * 0.62       # ~half of the S^2 part is skipped


def test_tensor_parallel_adds_ici_and_splits_work():
    r1 = _eval("llama3-70b", "v5p", "2x2x2", Parallelism(8), "prefill", [1], [2048])
    r2 = _eval("llama3-70b", "v5p", "4x2x2", Parallelism(16), "prefill", [1], [2048])
    assert r1.ici_bytes[0, 0] > 0
    assert r2.flops[0, 0] < 0.6 * r1.flops[0, 0]
    r_pp = _eval("llama3-70b", "v5p", "2x2x2", Parallelism(1, 8), "prefill", [1], [2048])
    assert r_pp.ici_bytes[0, 0] < r1.ici_bytes[0, 0]


def test_moe_decode_reads_only_active_experts():
    a = load_model("deepseek-v3")
    r1 = _eval("deepseek-v3", "v5p", "4x4x2", Parallelism(4, 1, 8), "decode", [1], [1024])
    r64 = _eval("deepseek-v3", "v5p", "4x4x2", Parallelism(4, 1, 8), "decode", [256], [1024])
    assert r1.hbm_bytes[0, 0] < 0.5 * r64.hbm_bytes[0, 0]
    assert r1.weights_bytes < a.weight_bytes() / 4 * 1.2


def test_collective_models():
    v5p = CAT.get("v5p")
    ring = allreduce_cost([(4, False)], v5p)
    torus = allreduce_cost([(4, True)], v5p)
    assert torus.beta_s_per_byte == pytest.approx(ring.beta_s_per_byte / 2)
    assert ring.gamma == pytest.approx(2 * 3 / 4)
    two_d = allreduce_cost([(4, False), (4, False)], v5p)
    line = allreduce_cost([(16, False)], v5p)
    assert two_d.beta_s_per_byte < line.beta_s_per_byte and two_d.alpha_s < line.alpha_s
    assert two_d.gamma == pytest.approx(line.gamma)        # same bytes, more links at once
    assert alltoall_cost([(8, False)], v5p).beta_s_per_byte > \
        alltoall_cost([(8, True)], v5p).beta_s_per_byte
    gd = group_dims(ICITopology((4, 4, 4)), v5p, Parallelism(16, 2, 2))
    assert gd["tp"] == [(4, True), (4, True)] and gd["ep"] == [(2, False)]
    assert gd["pp"] == [(2, False)]


def test_parallelism_enumeration_and_validation():
    l8 = load_model("llama3-8b")
    assert {p.chips for p in enumerate_parallelisms(l8, 16)} == {16}
    assert all(p.ep == 1 and p.tp <= 32 for p in enumerate_parallelisms(l8, 256))
    ds = load_model("deepseek-v3")
    assert any(p.ep == 256 for p in enumerate_parallelisms(ds, 1024))
    with pytest.raises(NeuScaleError, match="needs a mixture-of-experts"):
        validate_parallelism(l8, Parallelism(1, 1, 2))
    with pytest.raises(NeuScaleError, match="exceeds the model's 32 attention heads"):
        validate_parallelism(l8, Parallelism(64))
    assert sum(n * (d + m) for d, m, _, _, n in stage_layout(ds, 16)) == 61
    assert stage_layout(ds, 1) == [(3, 58, True, True, 1)]


@pytest.mark.parametrize("model,chip,topo,par", [
    ("llama3-8b", "v6e", "1x1", Parallelism(1)),
    ("llama3-70b", "v5p", "2x2x2", Parallelism(8)),
])
def test_fused_traffic_model_against_xla_unfused_bytes(model, chip, topo, par):
    """Dense decode: every op touches HBM anyway, so the fused model is close to XLA's unfused
    count, lower by the fp32 softmax intermediates that grow with batch. Prefill: XLA's count is
    dominated by the S x S score tensors a flash kernel keeps on chip: far below it."""
    d = _eval(model, chip, topo, par, "decode", [1, 8, 64], [2048])
    ratio = d.hbm_bytes[:, 0] / d.xla_bytes[:, 0]
    assert ((ratio > 0.6) & (ratio < 1.05)).all(), ratio
    assert ratio[0] > 0.95
    p = _eval(model, chip, topo, par, "prefill", [1], [4096])
    assert p.hbm_bytes[0, 0] < 0.2 * p.xla_bytes[0, 0]


def test_fused_moe_traffic_counts_only_routed_experts():
    """XLA's expert graph reads every local expert; the fused model only those a token reaches,
    so the two converge as the batch grows and every expert is reached (~64 sequences)."""
    d = _eval("deepseek-v3", "v5p", "4x4x2", Parallelism(4, 1, 8), "decode", [1, 8, 64],
              [2048])
    ratio = d.hbm_bytes[:, 0] / d.xla_bytes[:, 0]
    assert ratio[0] < 0.3 and ratio[0] < ratio[1] < ratio[2] and ratio[2] > 0.75, ratio


def test_roofline_prices_the_vpod_with_the_catalog_and_reexports_the_split_and_torus():
    import dse.costmodel as cm
    import dse.parallel
    import dse.torus
    for mod in (dse.parallel, dse.torus):
        for name in mod.__all__:
            assert getattr(cm, name) is getattr(mod, name)
    r = _eval("llama3-70b", "v5p", "2x2x2", Parallelism(4, 2), "decode", [1, 16], [1024, 8192])
    np.testing.assert_array_equal(r.cost_usd, CAT.get("v5p").vpod_usd(8, r.cycle_s))
