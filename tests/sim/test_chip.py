"""The per-operator chip model: tiling, SRAM re-reads, collectives, MoE imbalance, energy."""
import math

import numpy as np
import pytest

from dse.stacks import get_stack

from dse import default_catalog, load_model
from dse.builder import DSE, Candidate
from dse.costmodel import Parallelism
from dse.vpod import ICITopology
from sim.chip import ChipModel
from sim.hardware import OVERLAP, hardware

CAT = default_catalog()


def model(name="llama3-8b", chip="v6e", topo="1x1", par=Parallelism(1)):
    c = CAT.get(chip)
    return ChipModel(load_model(name), c, ICITopology.parse(topo).for_chip(c), par)


def test_clock_and_units_reproduce_peak():
    for c in CAT:
        hw = hardware(c)
        assert hw.mxus * c.systolic_width ** 2 * 2 * hw.clock_hz == pytest.approx(
            c.peak_flops_per_s)
    assert hardware(CAT.get("v4")).clock_hz == pytest.approx(1.05e9, rel=0.01)
    assert hardware(CAT.get("v5p")).clock_hz == pytest.approx(1.75e9, rel=0.01)


def test_energy_calibration_matches_table2_peaks():
    """A big square matmul at full SA use, and a pure HBM stream, hit Table 2's maxima."""
    for c in CAT:
        cm = model(chip=c.name, topo="1x1" if c.torus_dims == 2 else "1x1x1")
        hw = cm.hw
        n = 8192
        op = cm.matmul("big", n, n, n, weights=False, a_bytes=0.0)
        op.hbm_bytes = 0.0
        e = op.energy_j(hw) + hw.static_power_w * op.sa_flops / c.peak_flops_per_s
        assert op.sa_flops / e == pytest.approx(c.max_flop_per_j, rel=1e-9)
        nbytes = 1e9
        e_mem = nbytes * (hw.e_hbm_j_per_byte + hw.e_sram_j_per_byte) + \
            hw.static_power_w * nbytes / c.hbm_bw_bytes_per_s
        assert nbytes / e_mem == pytest.approx(c.max_hbm_bytes_per_j, rel=1e-9)


def test_tile_quantisation_to_array_width():
    v6e, v5e = model(chip="v6e"), model(chip="v5e")
    # N = 128 fills half of a 256-wide array: same time as N = 256 on v6e
    a = v6e.matmul("a", 4096, 4096, 128, weights=False, a_bytes=0.0)
    b = v6e.matmul("b", 4096, 4096, 256, weights=False, a_bytes=0.0)
    assert a.sa_flops * 2 == b.sa_flops and a.unit == b.unit == "SA"
    assert a.time_s == pytest.approx(b.time_s, rel=0.02)
    # small M: one row costs as much array time as w rows
    one = v5e.matmul("m1", 1, 8192, 8192, weights=False, a_bytes=0.0)
    full = v5e.matmul("m128", 128, 8192, 8192, weights=False, a_bytes=0.0)
    t_sa = lambda o: (o.time_s - 2e-6)  # noqa: E731
    assert t_sa(one) == pytest.approx(t_sa(full), rel=0.05)


def test_sram_limited_tiling_rereads_weights():
    cm = model(chip="v5e")                       # 64 MB SRAM
    sram = cm.hw.sram_bytes
    K = N = 4096
    fits = cm.matmul("fits", int(sram / 2 / (K * 2)) - 1, K, N)
    spills = cm.matmul("spills", int(4 * sram / 2 / (K * 2)), K, N)
    w_bytes = K * N * 2
    assert fits.hbm_bytes == pytest.approx(w_bytes + (fits.sa_flops / (2 * N)) * 2 +
                                           (fits.sa_flops / (2 * K)) * 2, rel=1e-6)
    # 4x the activation block -> the weights are read 4 times
    M = spills.sa_flops / (2 * K * N)
    assert spills.hbm_bytes == pytest.approx(4 * w_bytes + M * K * 2 + M * N * 2, rel=1e-6)


def test_overlap_inside_an_op():
    cm = model()
    op = cm.vector("v", 1e6, 1000, 1e9)            # both units busy
    tv = 1e9 / cm.hw.vu_flops_per_s
    tm = 1e9 / cm.hw.hbm_bw_eff_bytes_per_s + 1e-6
    assert op.time_s == pytest.approx(max(tv, tm) + (1 - OVERLAP) * min(tv, tm) + 2e-6)


def test_gqa_decode_reads_kv_heads_and_mla_reads_latent():
    l70 = model("llama3-70b", "v5p", "2x2x2", Parallelism(8))
    ops = {o.name: o for o in l70.attention(0, 0, 4, 4 * 1000)}
    # tp8 of 8 KV heads: one KV head of 128 dims, K and V, bf16, per cached token
    assert ops["attn_decode_scores"].hbm_bytes >= 4000 * 2 * 1 * 128 * 2
    assert ops["attn_decode_scores"].hbm_bytes < 4000 * 2 * 1 * 128 * 2 * 1.1
    ds = model("deepseek-v3", "v5p", "4x4x2", Parallelism(4, 1, 8))
    ops = {o.name: o for o in ds.attention(0, 0, 4, 4 * 1000)}
    assert ops["attn_decode_scores"].hbm_bytes >= 4000 * 576 * 2
    assert ops["attn_decode_scores"].hbm_bytes < 4000 * 576 * 2 * 1.1


def test_collectives_scale_with_group_and_wraparound():
    small = model("llama3-70b", "v5p", "2x2x2", Parallelism(8))
    cube = model("llama3-70b", "v5p", "4x4x4", Parallelism(64))
    msg = 64e6
    assert small.allreduce("x", msg).ici_bytes == pytest.approx(2 * msg * 7 / 8, rel=0.01)
    # the 4x4x4 cube has wrap-around links: per-chip time grows far less than 8x the chips
    assert cube.allreduce("x", msg).time_s < 2.5 * small.allreduce("x", msg).time_s
    assert model().allreduce("x", msg).time_s == 0.0   # tp = 1


def test_moe_hot_expert_sets_the_pace():
    ds = model("deepseek-v3", "v5p", "4x4x2", Parallelism(4, 1, 8))
    ops = {o.name: o for o in ds.moe_block(512, 4096)}
    mean = 4096 * 8 / 256
    hot = ops["experts_hot_gate_up"]
    assert hot.sa_flops == pytest.approx(2 * 7 * mean * 7168 * 2 * 512)
    rest = ops["experts_rest_gate_up"]
    assert rest.sa_flops / hot.sa_flops < 32 * mean / (7 * mean)


def test_pipeline_bubbles_and_step_overhead():
    a = model("llama3-70b", "v6e", "4x2", Parallelism(1, 8))
    a.stack = get_stack("jetstream")        # host time added to each step (no overlap)
    host = a.stack.step_s
    r1 = a.step("prefill", 1, 1024)
    r8 = a.step("prefill", 8, 1024)
    st = max(r8.stage_times_s)
    # 8 micro-batches: fill through all stages, then 7 more bottleneck slots
    assert r8.latency_s == pytest.approx(sum(r8.stage_times_s) + host + 7 * st, rel=1e-9)
    assert r1.latency_s == pytest.approx(sum(r1.stage_times_s) + host, rel=1e-9)
    assert len(r8.stage_times_s) == 8


def test_chip_model_is_slower_than_the_roofline_and_ranks_alike():
    """The roofline is an optimistic bound of the detailed model; both agree on ordering."""
    a = load_model("llama3-70b")
    dse = DSE(a, CAT)
    rows = []
    for chip, topo, par in [("v5p", "2x2x2", Parallelism(8)), ("v6e", "4x2", Parallelism(8)),
                            ("v4", "2x2x2", Parallelism(8)), ("v5e", "4x4", Parallelism(16))]:
        c = CAT.get(chip)
        t = ICITopology.parse(topo).for_chip(c)
        dse.ensure_fits([par])
        for ph, b, s in (("prefill", 1, 2048), ("decode", 64, 2048)):
            r = ChipModel(a, c, t, par).step(ph, b, s)
            rr = dse.evaluate(Candidate(c, t, par), ph, np.asarray([b]), np.asarray([s]))
            assert r.latency_s > rr.latency_s[0, 0]
            rows.append((ph, r.latency_s, float(rr.latency_s[0, 0])))
    for ph in ("prefill", "decode"):
        sim = [x[1] for x in rows if x[0] == ph]
        roof = [x[2] for x in rows if x[0] == ph]
        assert np.argsort(sim).tolist() == np.argsort(roof).tolist()
    assert not math.isnan(rows[0][1])


def test_chip_model_of_resolves_names_and_aliases():
    a = load_model("deepseek-v3")
    cm = ChipModel.of(a, CAT, "NPU-C", "4x4x2", 4, ep=8)
    assert cm.chip is CAT.get("v5p") and cm.par == Parallelism(4, 1, 8)
    assert cm.topo == ICITopology.parse("4x4x2").for_chip(cm.chip)
    ref = model("deepseek-v3", "v5p", "4x4x2", Parallelism(4, 1, 8))
    assert cm.step("decode", 64, 2048) == ref.step("decode", 64, 2048)
