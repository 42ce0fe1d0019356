"""The three MoE stage layouts (issue 14 part 4): ``Parallelism.attn == "dp"`` (attention
data-parallel over the ep groups, experts TP inside each), ``"tp"`` (attention tensor-parallel
over all tp*ep chips of the stage, whole experts expert-parallel over the same chips) and
``"hybrid"`` (attention as "dp", experts as "tp": what vLLM runs for a data-parallel vPod), in
the roofline (dse/costmodel.py), the chip model (sim/chip.py), the enumeration (per serving
stack), the database, the engine command line and the simulated engine's reading of it."""
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from backends.base import ConfigError, VPodSpec
from backends.engine import EngineSettings, vllm_argv
from backends.sim.engine_server import _parser as engine_parser, vllm_layout
from dse import BuildOptions, NeuScaleError, build, default_catalog, load_model
from dse.builder import DSE, Candidate
from dse.costmodel import (CostModel, HBM_USABLE_FRACTION, Parallelism, allreduce_cost,
                           alltoall_cost, collectives, enumerate_parallelisms, group_dims,
                           validate_parallelism)
from dse.db import BestFitDB
from dse.stacks import get_stack, parse_stack
from dse.vpod import ICITopology
from sim.chip import ChipModel
from sim.validate import spearman

CAT = default_catalog()
DS = load_model("deepseek-v3")
B2 = 2


def _topo(chip: str, shape: str) -> ICITopology:
    return ICITopology.parse(shape).for_chip(CAT.get(chip))


def _chip_model(par: Parallelism, chip="v5p", shape="4x4x2", arch=DS) -> ChipModel:
    return ChipModel(arch, CAT.get(chip), _topo(chip, shape), par)


DP = Parallelism(4, 1, 8)             # 8 attention DP groups of TP 4, experts TP 4 in 8 groups
TPA = Parallelism(1, 1, 32, "tp")     # attention TP 32, 8 whole experts per chip
HYB = Parallelism(4, 1, 8, "hybrid")  # 8 attention DP groups of TP 4, 8 whole experts per chip


# ---- representation and enumeration -------------------------------------------------------

def test_the_layout_is_part_of_identity_name_and_order():
    a, b = Parallelism(1, 2, 16), Parallelism(1, 2, 16, "tp")
    assert a != b and hash(a) != hash(b) and len({a, b}) == 2
    assert str(a) == "tp1-pp2-ep16" and str(b) == "tp1-pp2-ep16-tpattn"
    assert sorted([b, a]) == [a, b]
    assert (b.attn_tp, b.dp, b.moe_ep, b.moe_tp, b.stage_chips) == (16, 1, 16, 1, 16)
    assert (DP.attn_tp, DP.dp, DP.moe_ep, DP.moe_tp, DP.stage_chips) == (4, 8, 8, 4, 32)
    # tp * ep is what the layout uses: tp2-ep8 is the same split as tp1-ep16
    assert Parallelism(2, 1, 8, "tp").attn_tp == Parallelism(1, 1, 16, "tp").attn_tp == 16


def test_bad_layouts_get_one_clear_error():
    with pytest.raises(NeuScaleError, match="exceeds the model's 128 attention heads"):
        validate_parallelism(DS, Parallelism(1, 1, 256, "tp"))
    validate_parallelism(DS, Parallelism(1, 1, 128, "tp"))           # 128 heads, 1 each
    with pytest.raises(NeuScaleError, match="needs a mixture-of-experts model"):
        validate_parallelism(load_model("llama3-8b"), Parallelism(2, 1, 1, "tp"))
    with pytest.raises(NeuScaleError, match="attention layout 'xx' must be one of dp, tp"):
        validate_parallelism(DS, Parallelism(1, 1, 8, "xx"))
    with pytest.raises(NeuScaleError, match="exceeds the model's 128 attention heads"):
        ChipModel.of(DS, CAT, "v5p", "8x8x4", 1, 1, 256, attn="tp")


def test_enumeration_has_both_layouts_for_moe_and_only_dp_for_dense():
    for n in (16, 64, 256, 1024):
        pars = enumerate_parallelisms(DS, n)
        tpa = [p for p in pars if p.attn == "tp"]
        dp = [p for p in pars if p.attn == "dp"]
        # one tensor-parallel-attention split per stage size N = tp*ep >= 2, N <= 128 heads
        want = {(n // s, s) for s in (2, 4, 8, 16, 32, 64, 128) if s <= n and n // s <= 61}
        assert {(p.pp, p.ep) for p in tpa} == want and all(p.tp == 1 for p in tpa)
        assert any(p.ep > 1 for p in dp) and len(set(pars)) == len(pars)
        for p in pars:
            validate_parallelism(DS, p)
    for name in ("llama3-8b", "llama3-70b"):
        a = load_model(name)
        pars = enumerate_parallelisms(a, 64)
        assert pars and all(p.attn == "dp" and p.ep == 1 for p in pars)


def test_the_new_layout_reuses_the_old_layouts_fits():
    """Attention/MLP/shared expert/LM head at TP tp*ep and experts at TP 1, EP tp*ep are graphs
    the "dp" layout lowers already: no new XLA fit is needed."""
    dp_keys, tp_keys = set(), set()
    for n in (16, 32, 64, 128, 256):
        for p in enumerate_parallelisms(DS, n):
            keys = {p.fit_key(c) for c, *_ in CostModel.fit_keys(DS, [p])}
            (tp_keys if p.attn == "tp" else dp_keys).update(keys)
    assert tp_keys and tp_keys <= dp_keys
    assert TPA.fit_key("experts") == "experts|tp=1|ep=32"
    assert TPA.fit_key("attn_decode") == "attn_decode|tp=32"
    d = TPA.shard(DS)
    assert (d.heads, d.experts, d.moe_inter) == (4, 8, DS.moe_intermediate)
    assert d.shared_inter == math.ceil(DS.n_shared_experts * DS.moe_intermediate / 32)
    d0 = DP.shard(DS)
    assert (d0.heads, d0.experts, d0.moe_inter) == (32, 32, DS.moe_intermediate // 4)


# ---- physics: KV replication, collectives -----------------------------------------------

def _work(par, phase, B, S):
    dse = DSE(DS, CAT)
    dse.ensure_fits([par])
    return dse, dse.cost.work(par, phase, np.asarray(B), np.asarray(S))


def test_mla_latent_kv_is_replicated_on_every_chip_under_tensor_parallel_attention():
    B, S = 256, 4096
    lat = DS.kv_lora_rank + DS.qk_rope_head_dim             # 576 per token per layer
    layers = DS.layers
    _, w_dp = _work(DP, "decode", [B], [S])
    _, w_tp = _work(TPA, "decode", [B], [S])
    kv_dp = float(w_dp.stages[0].kv_bytes[0, 0])
    kv_tp = float(w_tp.stages[0].kv_bytes[0, 0])
    assert kv_dp == pytest.approx(B / 8 * S * lat * B2 * layers)      # its DP group's 32 seqs
    assert kv_tp == pytest.approx(B * S * lat * B2 * layers)          # all 256, on every chip
    # the chip model holds the same: memory grows with every sequence, capacity is 1 group's
    cm_dp, cm_tp = _chip_model(DP), _chip_model(TPA)
    per_tok = lat * B2 * layers
    assert cm_tp.memory_bytes("decode", B, S) - cm_tp.weights_bytes() == \
        pytest.approx(B * S * per_tok)
    assert cm_dp.memory_bytes("decode", B, S) - cm_dp.weights_bytes() == \
        pytest.approx(B / 8 * S * per_tok)
    usable = HBM_USABLE_FRACTION * CAT.get("v5p").hbm_bytes
    assert cm_tp.kv_capacity_tokens() == int((usable - cm_tp.weights_bytes()) // per_tok)
    assert cm_dp.kv_capacity_tokens() == 8 * int((usable - cm_dp.weights_bytes()) // per_tok)
    # a batch the DP layout holds overflows the TP layout's HBM
    dse = DSE(DS, CAT)
    dse.ensure_fits([DP, TPA])
    big = np.asarray([64]), np.asarray([32768])        # 2M tokens: 18 GB per dp chip
    r_dp = dse.evaluate(Candidate(CAT.get("v5p"), _topo("v5p", "4x4x2"), DP), "decode", *big)
    r_tp = dse.evaluate(Candidate(CAT.get("v5p"), _topo("v5p", "4x4x2"), TPA), "decode", *big)
    assert r_dp.feasible[0, 0] and not r_tp.feasible[0, 0] and r_tp.reason[0, 0] == 1


def test_attention_allreduce_spans_the_stage_and_experts_have_no_tp_reduction():
    chip, topo = CAT.get("v5p"), _topo("v5p", "4x4x2")
    gd = group_dims(topo, chip, TPA)
    assert math.prod(k for k, _ in gd["tp"]) == 32 and gd["ep"] == gd["tp"]
    assert math.prod(k for k, _ in group_dims(topo, chip, DP)["tp"]) == 4
    c = collectives(topo, chip, TPA)
    assert c["ar"] == allreduce_cost(gd["tp"], chip) and c["a2a"] == alltoall_cost(gd["ep"], chip)
    # roofline: 2 all-reduces per layer (attention; dense MLP or shared expert) of all tokens
    B = 64
    _, w = _work(TPA, "decode", [B], [4096])
    coll = {k: (n, float(np.ravel(m)[0])) for k, n, m in w.stages[0].coll}
    H, k_top = DS.hidden, DS.experts_per_token
    assert coll["ar"] == (2 * DS.layers, pytest.approx(B * H * B2))
    n_moe = DS.layer_kinds().count("moe")                  # 58: the first 3 layers are dense
    assert coll["a2a"] == (2 * n_moe, pytest.approx(B / 32 * k_top * H * B2 * 31 / 32))
    # chip model: the all-reduce is the 32-chip collective; the experts are whole (full width)
    cm = _chip_model(TPA)
    ops = {o.name: o for o in cm.moe_block(B, B)}
    assert ops["moe_allreduce"].ici_bytes == pytest.approx(c["ar"].gamma * B * H * B2)
    hot = 7 * B * k_top / DS.n_routed_experts        # MOE_HOT_FACTOR x the mean load
    assert ops["experts_hot_gate_up"].sa_flops == pytest.approx(
        2 * hot * H * 2 * DS.moe_intermediate)
    assert ops["dispatch_a2a"].ici_bytes == pytest.approx(
        c["a2a"].gamma * B / 32 * k_top * H * B2 * 31 / 32)
    # without a shared expert nothing is left to all-reduce after the experts ("tp" layout);
    # the "dp" layout still reduces the experts' TP partial sums
    no_shared = replace(DS, n_shared_experts=0)
    names_tp = {o.name for o in _chip_model(TPA, arch=no_shared).moe_block(B, B)}
    names_dp = {o.name for o in _chip_model(DP, arch=no_shared).moe_block(B / 8, B)}
    assert "moe_allreduce" not in names_tp and "moe_allreduce" in names_dp
    assert "attn_allreduce" in {o.name for o in cm.attention_block(B, 0, 0, B, B * 4096)}


def test_hot_expert_is_per_chip_in_both_layouts():
    """The chip hosting the hottest expert (MOE_HOT_FACTOR x the mean load) sets the pace;
    each chip holds 8 experts in both splits, so the hot expert's work is the same, but whole
    (tp layout) instead of a quarter of its width on each of 4 chips (dp layout)."""
    t = 4096
    hot_tp = {o.name: o for o in _chip_model(TPA).moe_block(t, t)}["experts_hot_gate_up"]
    hot_dp = {o.name: o for o in _chip_model(DP).moe_block(t / 8, t)}["experts_hot_gate_up"]
    assert hot_tp.sa_flops == pytest.approx(4 * hot_dp.sa_flops)


# ---- the roofline and the chip model agree on the new layout --------------------------------

@pytest.mark.parametrize("attn", ["tp", "hybrid"])
@pytest.mark.parametrize("phase,seq", [("prefill", 4096), ("decode", 5120)])
def test_roofline_and_chip_model_rank_new_layout_allocations_alike(phase, seq, attn):
    dse = DSE(DS, CAT)
    cands = [Candidate(c, t, p) for c in (CAT.get("v5p"), CAT.get("v6e"))
             for t, p in ((cd.topo, cd.par) for cd in dse.candidates(c, 64))
             if p.attn == attn
             and dse.cost.max_weights_bytes(p) <= HBM_USABLE_FRACTION * c.hbm_bytes]
    dse.ensure_fits({c.par for c in cands})
    B = np.asarray([1, 4, 16, 64, 256])
    pred_l, pred_e, sim_l, sim_e = [], [], [], []
    for cd in cands:
        r = dse.evaluate(cd, phase, B, np.asarray([seq]))
        cm = ChipModel(DS, cd.chip, cd.topo, cd.par)
        for i, b in enumerate(B):
            if not r.feasible[i, 0]:
                continue
            s = cm.step(phase, int(b), seq)
            pred_l.append(r.latency_s[i, 0])
            pred_e.append(1 / r.energy_j_per_token[i, 0])
            sim_l.append(s.latency_s)
            sim_e.append(s.tokens / s.energy_j)
    assert len(pred_l) >= 30
    assert spearman(pred_l, sim_l) > 0.97
    assert spearman(pred_e, sim_e) > 0.97


def test_tensor_parallel_attention_wins_short_prefill_and_loses_long_decode():
    """What the layout trades (v5p, 64 chips): at batch 1 the "dp" layout leaves 7 of 8
    attention groups idle, the "tp" layout uses all 64 chips on one prompt; in decode every "tp"
    chip reads all sequences' latent KV, 8x a "dp" chip's."""
    dp, tp = ChipModel.of(DS, CAT, "v5p", "4x4x4", 8, 1, 8), \
        ChipModel.of(DS, CAT, "v5p", "4x4x4", 1, 1, 64, attn="tp")
    assert tp.step("prefill", 1, 4096).latency_s < 0.5 * dp.step("prefill", 1, 4096).latency_s
    d_tp, d_dp = tp.step("decode", 64, 8192), dp.step("decode", 64, 8192)
    usable = HBM_USABLE_FRACTION * CAT.get("v5p").hbm_bytes
    assert d_dp.hbm_bytes_per_chip < d_tp.hbm_bytes_per_chip <= usable      # both fit
    assert d_tp.latency_s > 1.5 * d_dp.latency_s


# ---- a built database --------------------------------------------------------------------

@pytest.fixture(scope="module")
def ds_db(tmp_path_factory):
    """deepseek-v3 on v5p up to 64 chips (the 63 XLA fits this needs are lowered once)."""
    db = build("deepseek-v3", BuildOptions(chips=("v5p",), max_chips=64,
                                           buckets=(1024, 8192, 65536), workers=2,
                                           progress=False))
    path = tmp_path_factory.mktemp("ds") / "bestfit-deepseek-v3-energy.json"
    db.save(path)
    return db, path


def test_built_fronts_hold_the_stacks_layouts_and_decode_keeps_attention_data_parallel(ds_db):
    db, _ = ds_db
    assert db.meta["pareto_columns"][5] == "attn"
    seen = {ph: set() for ph in ("prefill", "decode")}
    for key in db.pareto:
        ph, edge, chip = key.split("|")
        for p in db.pareto_for(ph, int(edge), chip):
            seen[ph].add(p["attn"])
            # built for vllm-tpu: no TP inside an expert group of a data-parallel vPod
            assert not (p["attn"] == "dp" and p["tp"] > 1 and p["ep"] > 1), p
    # prefill fronts hold all three (the "tp" layout's low-latency end)
    assert seen["prefill"] == {"dp", "tp", "hybrid"}
    # decode best fits keep attention data-parallel: each chip reads only its group's latent KV
    dec = db.entries_for("decode", "v5p")
    assert dec and all(e.feasible and e.attn in ("dp", "hybrid") for e in dec)
    assert any(e.attn == "hybrid" for e in dec)
    for e in db.entries:
        validate_parallelism(DS, e.parallelism)


def test_old_database_without_the_layout_loads_as_dp(ds_db, tmp_path):
    _, path = ds_db
    data = json.loads(path.read_text())
    i = data["pareto_columns"].index("attn")
    data["pareto_columns"].pop(i)
    data["pareto"] = {k: [[*r[:i], *r[i + 1:]] for r in rows if r[i] == "dp"]
                      for k, rows in data["pareto"].items()}
    for e in data["entries"]:
        del e["attn"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    db = BestFitDB.load(old)
    assert {e.attn for e in db.entries} == {"dp"}
    front = db.pareto_for("decode", 1024, "v5p")
    assert front and {p["attn"] for p in front} == {"dp"}
    data["entries"][0]["attn"] = "sideways"
    old.write_text(json.dumps(data))
    with pytest.raises(NeuScaleError, match=r"entries\[0\]\.attn 'sideways' is not one of dp, tp"):
        BestFitDB.load(old)


# ---- the engine command line ---------------------------------------------------------------

def _spec(**kw) -> VPodSpec:
    d = dict(id="c-d0001-abcd", group="g", phase="prefill", model="deepseek-v3", chip="v5p",
             topology="4x4x4", num_chips=64, tp=1, pp=1, ep=64, max_batch=8,
             max_model_len=8192)
    d.update(kw)
    return VPodSpec(**d)


def test_vllm_argv_of_the_tensor_parallel_attention_layout():
    s = EngineSettings(model="deepseek-ai/DeepSeek-V3", served_model_name="deepseek-v3")
    a = " ".join(vllm_argv(_spec(attn="tp"), s))
    assert "--tensor-parallel-size 64" in a and "--enable-expert-parallel" in a
    assert "--data-parallel-size" not in a and "--max-num-seqs 8" in a
    a = " ".join(vllm_argv(_spec(tp=2, ep=32, attn="tp"), s))
    assert "--tensor-parallel-size 64" in a and "--data-parallel-size" not in a
    d = " ".join(vllm_argv(_spec(tp=8, ep=8, attn="hybrid"), s))
    assert "--tensor-parallel-size 8" in d and "--data-parallel-size 8" in d
    assert "--max-num-seqs 1" in d and "--enable-expert-parallel" in d
    # TP inside the expert groups of a data-parallel vPod is not something vLLM launches
    with pytest.raises(ConfigError, match="not a layout vLLM can launch"):
        vllm_argv(_spec(tp=8, ep=8), s)
    d1 = " ".join(vllm_argv(_spec(tp=1, ep=64), s))       # tp 1: the dp layout is the hybrid
    assert "--tensor-parallel-size 1" in d1 and "--data-parallel-size 64" in d1
    # the spec carries the layout through JSON; a spec written before it is "dp"
    j = _spec(attn="tp").to_json()
    assert VPodSpec.from_json(j).attn == "tp"
    del j["attn"]
    assert VPodSpec.from_json(j).attn == "dp"
    assert any("attn 'x'" in p for p in _spec(attn="x").problems())


def test_controller_state_written_before_the_layout_column_opens_as_dp(tmp_path):
    import sqlite3

    from orchestrator.state import _SCHEMA, StateStore, VPodRow
    old_schema = _SCHEMA.replace(", attn TEXT NOT NULL DEFAULT 'dp'", "")
    assert old_schema != _SCHEMA
    path = tmp_path / "state.db"
    con = sqlite3.connect(path)
    con.executescript(old_schema)
    con.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    con.execute("INSERT INTO vpods (id, grp, phase, chip, topology, num_chips, tp, pp, ep, "
                "max_batch, max_model_len, throughput_tok_per_s, failover, state, endpoint, "
                "created_at) VALUES ('v1', 'g', 'decode', 'v5p', '4x4x2', 32, 4, 1, 8, 64, "
                "8192, 100.0, 0, 'ready', NULL, 1.0)")
    con.commit()
    con.close()
    st = StateStore(path)
    assert [v.attn for v in st.vpods()] == ["dp"]
    st.add_vpod(VPodRow("v2", "g", "prefill", "v5p", "4x4x4", 64, 1, 1, 64, 8, 8192, 10.0,
                        False, "starting", None, 2.0, attn="tp"))
    assert [v.attn for v in st.vpods()] == ["dp", "tp"]
    st.close()


# ---- the hybrid layout: what vLLM runs for a data-parallel MoE vPod -----------------------

def test_hybrid_takes_attention_from_dp_and_experts_from_tp():
    assert str(HYB) == "tp4-pp1-ep8-hybrid" and HYB != Parallelism(4, 1, 8)
    assert (HYB.attn_tp, HYB.dp, HYB.moe_ep, HYB.moe_tp, HYB.stage_chips) == (4, 8, 32, 1, 32)
    d, d_tp, d_dp = HYB.shard(DS), TPA.shard(DS), DP.shard(DS)
    assert (d.heads, d.inter, d.shared_inter) == (d_dp.heads, d_dp.inter, d_dp.shared_inter)
    assert (d.experts, d.moe_inter) == (d_tp.experts, d_tp.moe_inter) == (8, DS.moe_intermediate)
    # no new XLA graph: attention at TP 4 and experts at TP 1 EP 32 are the dp layout's
    dp_keys = {Parallelism(4, 1, 8).fit_key(c) for c, *_ in CostModel.fit_keys(DS, [DP])} | \
        {Parallelism(1, 1, 32).fit_key(c) for c, *_ in CostModel.fit_keys(DS, [DP])}
    assert {HYB.fit_key(c) for c, *_ in CostModel.fit_keys(DS, [HYB])} <= dp_keys
    validate_parallelism(DS, HYB)
    for bad, msg in ((Parallelism(1, 1, 8, "hybrid"), "it is the dp layout"),
                     (Parallelism(8, 1, 1, "hybrid"), "tp=1, ep=8 with attn tp"),
                     (Parallelism(8, 1, 64, "hybrid"), "tp\\*ep=512 exceeds the model's 256")):
        with pytest.raises(NeuScaleError, match=msg):
            validate_parallelism(DS, bad)
    with pytest.raises(NeuScaleError, match="hybrid layout needs a mixture-of-experts"):
        validate_parallelism(load_model("llama3-8b"), Parallelism(2, 1, 2, "hybrid"))


def test_hybrid_all_to_all_spans_the_stage_with_a_tp_slice_of_each_groups_tokens():
    chip, topo = CAT.get("v5p"), _topo("v5p", "4x4x2")
    gd = group_dims(topo, chip, HYB)
    assert math.prod(k for k, _ in gd["tp"]) == 4          # attention all-reduce: TP group
    assert math.prod(k for k, _ in gd["ep"]) == 32         # dispatch/combine: the whole stage
    assert gd["ep"] == group_dims(topo, chip, TPA)["ep"]   # laid as the tp layout's stage
    c = collectives(topo, chip, HYB)
    B, H, k_top = 64, DS.hidden, DS.experts_per_token
    _, w = _work(HYB, "decode", [B], [4096])
    coll = {k: (n, float(np.ravel(m)[0])) for k, n, m in w.stages[0].coll}
    n_moe = DS.layer_kinds().count("moe")
    t_grp = B / 8                                          # one DP group's sequences
    assert coll["a2a"] == (2 * n_moe, pytest.approx(t_grp / 4 * k_top * H * B2 * 31 / 32))
    # attention, dense MLP and shared expert reduce over the TP group; no expert-TP partials
    assert coll["ar"] == (2 * DS.layers, pytest.approx(t_grp * H * B2))
    cm = _chip_model(HYB)
    ops = {o.name: o for o in cm.moe_block(t_grp, B)}
    assert ops["dispatch_a2a"].ici_bytes == pytest.approx(
        c["a2a"].gamma * t_grp / 4 * k_top * H * B2 * 31 / 32)
    hot_tp = {o.name: o for o in _chip_model(TPA).moe_block(B, B)}["experts_hot_gate_up"]
    assert ops["experts_hot_gate_up"].sa_flops == pytest.approx(hot_tp.sa_flops)   # whole
    no_shared = replace(DS, n_shared_experts=0)
    names = {o.name for o in _chip_model(HYB, arch=no_shared).moe_block(t_grp, B)}
    assert "moe_allreduce" not in names
    # the dp layout's replicated dispatch (every TP chip sends its group's tokens) is tp x
    dp_ops = {o.name: o for o in _chip_model(DP).moe_block(t_grp, B)}
    assert dp_ops["dispatch_a2a"].ici_bytes > ops["dispatch_a2a"].ici_bytes


def test_a_short_prompt_runs_faster_hybrid_than_with_tp_inside_expert_groups():
    """At batch 1 both layouts run one attention group; the hybrid's dispatch is a 1/tp slice
    of the prompt where every dp chip sends all of it (v5p, 64 chips, TP 8 x EP 8)."""
    dp = ChipModel.of(DS, CAT, "v5p", "4x4x4", 8, 1, 8)
    hy = ChipModel.of(DS, CAT, "v5p", "4x4x4", 8, 1, 8, attn="hybrid")
    assert hy.step("prefill", 1, 4096).latency_s < 0.7 * dp.step("prefill", 1, 4096).latency_s
    # same weights and KV per chip
    assert hy.memory_bytes("decode", 64, 4096) == pytest.approx(dp.memory_bytes("decode", 64, 4096))


def test_the_serving_stack_decides_which_layouts_are_enumerated():
    def splits(stack, n=64):
        dse = DSE(DS, CAT, stack=stack)
        return {cd.par for cd in dse.candidates(CAT.get("v5p"), n) if cd.topo.num_chips == n}
    every, vllm = splits("none"), splits("vllm-tpu")
    assert {p.attn for p in every} == {"dp", "tp", "hybrid"}
    # vLLM: no TP inside expert groups; every hybrid and tp split, and dp where tp or ep is 1
    assert vllm == {p for p in every if not (p.attn == "dp" and p.tp > 1 and p.ep > 1)}
    assert Parallelism(8, 1, 8, "hybrid") in vllm and Parallelism(1, 1, 64) in vllm
    assert get_stack("sglang-jax").moe_layouts == ("tp", "hybrid")
    only_dp = parse_stack('{"name": "x", "step_s": 0, "per_seq_s": 0, "request_s": 0, '
                          '"moe_layouts": ["dp"]}')
    assert {p.attn for p in splits(only_dp)} == {"dp"}
    assert only_dp.to_json()["moe_layouts"] == ["dp"]              # JSON round trip
    for bad in ('[]', '["dp", "dp"]', '["sideways"]', '"dp"'):
        with pytest.raises(NeuScaleError, match="moe_layouts must be a non-empty list"):
            parse_stack('{"name": "x", "step_s": 0, "per_seq_s": 0, "request_s": 0, '
                        f'"moe_layouts": {bad}}}')
    # dense models see no layouts at all
    l8 = load_model("llama3-8b")
    assert {cd.par for cd in DSE(l8, CAT, stack="vllm-tpu").candidates(CAT.get("v5p"), 16)} == \
        {cd.par for cd in DSE(l8, CAT, stack="none").candidates(CAT.get("v5p"), 16)}


@pytest.mark.parametrize("par", [Parallelism(8, 1, 8, "hybrid"), Parallelism(1, 1, 64, "tp"),
                                 Parallelism(1, 1, 64), Parallelism(64, 1, 1),
                                 Parallelism(4, 2, 8, "hybrid")])
def test_the_simulated_engine_reads_the_launch_command_back_as_the_same_layout(par):
    """backends.engine.vllm_argv writes the vLLM flags of a spec; the simulated engine server
    (what a test host runs for the same command) reads them back as the same split."""
    s = EngineSettings(model="deepseek-ai/DeepSeek-V3", served_model_name="deepseek-v3")
    spec = _spec(tp=par.tp, pp=par.pp, ep=par.ep, attn=par.attn, max_batch=64,
                 num_chips=par.chips, topology="4x4x4" if par.chips == 64 else "4x4x8")
    argv = vllm_argv(spec, s)
    flags = argv[argv.index("--served-model-name"):]
    args = engine_parser().parse_args(["--model", "deepseek-v3", *flags])
    tp, ep, attn, ranks = vllm_layout(DS, args.tp, args.ep, args.dp, args.enable_expert_parallel)
    got = Parallelism(tp, args.pp, ep, attn)
    same = Parallelism(1, par.pp, par.tp * par.ep, "tp") if par.attn == "tp" else par
    assert got == same
    assert args.max_num_seqs * ranks >= 64


def test_the_simulated_engine_refuses_experts_tensor_parallel_over_data_parallel_ranks():
    with pytest.raises(NeuScaleError, match="--enable-expert-parallel"):
        vllm_layout(DS, 8, 1, 8, False)
    assert vllm_layout(load_model("llama3-8b"), 8, 1, None, False) == (8, 1, "dp", 1)


@pytest.mark.parametrize("par,shape", [(Parallelism(1, 1, 256), "8x8x4"),
                                       (Parallelism(2, 1, 128, "hybrid"), "8x8x4"),
                                       (Parallelism(4, 1, 8, "hybrid"), "4x4x2")])
def test_the_roofline_prices_the_chip_that_hosts_the_hottest_expert(par, shape):
    """Both models let the chip with the hottest expert (7x the mean load) set a MoE layer's
    pace. With 1-2 experts per chip that chip does up to 7x its mean share (the roofline used
    to price the mean: 2.3x faster than the chip model at large batches); with 8 per chip its
    other experts take the rest of its share and the mean holds."""
    from dse.parallel import MOE_HOT_FACTOR, busiest_expert_tokens
    B, S = 256, 4096
    t_stage = B * S
    mean = t_stage * DS.experts_per_token / DS.n_routed_experts
    e = par.shard(DS).experts
    busy = float(busiest_expert_tokens(e, mean, t_stage))
    assert busy == pytest.approx(max(e, MOE_HOT_FACTOR) * mean)
    # the chip model's expert operators hold the same tokens (the rest at >= 1 token each)
    cm = _chip_model(par, shape=shape)
    ops = cm.moe_block(t_stage / par.dp, t_stage)
    M = {o.name: o.sa_flops / (2 * DS.hidden * 2 * DS.moe_intermediate) for o in ops
         if o.name.startswith("experts_") and o.name.endswith("_gate_up")}
    assert sum(M.values()) == pytest.approx(busy, rel=0.02)
    # and the two models' step times stay close where they were 2.3x apart
    dse = DSE(DS, CAT)
    dse.ensure_fits([par])
    cd = Candidate(CAT.get("v5p"), _topo("v5p", shape), par)
    r = dse.evaluate(cd, "prefill", np.asarray([B]), np.asarray([S]))
    assert r.feasible[0, 0]
    ratio = cm.step("prefill", B, S).latency_s / r.latency_s[0, 0]
    assert 0.8 < ratio < 1.5, ratio


def test_group_ids_tell_the_three_layouts_of_one_split_apart(ds_db):
    """A database built for a stack that runs every layout (``none``) can hold the same split
    under two layouts; the policy keys groups by id, so the ids must differ."""
    from orchestrator.policy import GroupSpec
    db, _ = ds_db
    e = next(x for x in db.entries if x.attn == "hybrid")
    ids = {a: GroupSpec.of(replace(e, attn=a)).id for a in ("dp", "tp", "hybrid")}
    assert len(set(ids.values())) == 3
    assert ids["dp"] == f"{e.chip}:{e.topology}/tp{e.tp}pp{e.pp}ep{e.ep}/b{e.max_batch}"
    assert ids["hybrid"].endswith(f"ep{e.ep}hybrid/b{e.max_batch}")
