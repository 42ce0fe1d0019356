"""What a serving stack does beyond time constants (dse/stacks.py): prefill-first steps that do
not mix with decodes, padded prompt shapes, the all-gather MoE dispatch - and the busiest
expert group that a small-batch MoE step waits for (dse.parallel.busiest_active_experts)."""
import dataclasses

import numpy as np
import pytest

from dse.catalog import default_catalog
from dse.errors import NeuScaleError
from dse.models import load_model
from dse.parallel import busiest_active_experts
from dse.stacks import get_stack, parse_stack
from sim.chip import ChipModel
from sim.engine import Engine
from sim.stepcost import StepCostTable

from test_engine import Recorder, hand_cost

NONE = get_stack("none")


# ---------------------------------------------------------------- the busiest expert group

def _monte_carlo_busiest(experts_total, per_group, tokens, k, trials, rng):
    groups = experts_total // per_group
    out = []
    for _ in range(trials):
        routed = np.zeros(experts_total, dtype=bool)
        for _ in range(tokens):          # each token: k distinct experts, uniformly
            routed[rng.choice(experts_total, size=k, replace=False)] = True
        out.append(routed.reshape(groups, per_group).sum(axis=1).max())
    return float(np.mean(out))


@pytest.mark.parametrize("per_group,tokens", [(4, 16), (32, 16), (4, 64), (16, 4)])
def test_the_busiest_group_matches_a_simulation_of_routing(per_group, tokens):
    rng = np.random.default_rng(7)
    p = 1.0 - (1.0 - 8 / 256) ** tokens
    model = float(busiest_active_experts(per_group, 256, p))
    sim = _monte_carlo_busiest(256, per_group, tokens, 8, 400, rng)
    assert model == pytest.approx(sim, rel=0.06)
    assert per_group * p < model <= per_group        # above the mean, at most all of them


def test_the_busiest_group_is_the_mean_for_one_group_and_all_when_all_are_routed():
    assert busiest_active_experts(256, 256, 0.3) == pytest.approx(256 * 0.3)
    assert busiest_active_experts(4, 256, 1.0) == pytest.approx(4.0)
    assert busiest_active_experts(4, 256, 0.0) == pytest.approx(0.0)
    p = np.array([0.1, 0.4, 0.9])
    v = busiest_active_experts(8, 256, p)
    assert v.shape == (3,) and np.all(np.diff(v) > 0)


def test_a_small_decode_step_reads_the_busiest_chips_experts():
    """DeepSeek-V3, 16 sequences on 64 chips with 4 whole experts each: the chip that sets the
    pace reads ~3.8 experts' weights per layer, not the 1.6 a mean says."""
    arch, cat = load_model("deepseek-v3"), default_catalog()
    cm = ChipModel.of(arch, cat, "v6e", "8x8", 1, 1, 64, stack=NONE, attn="tp")
    ops = {o.name: o for o in cm.step("decode", 16, 1024).ops}
    gate_up = 2 * arch.hidden * arch.moe_intermediate * 2            # bytes of one expert
    read = sum(ops[n].hbm_bytes for n in ("experts_hot_gate_up", "experts_rest_gate_up")
               if n in ops)
    busiest = float(busiest_active_experts(4, 256, 1 - (1 - 8 / 256) ** 16))
    assert read == pytest.approx(busiest * gate_up, rel=0.05)
    assert read > 2 * (4 * (1 - (1 - 8 / 256) ** 16)) * gate_up     # over twice the mean


# ---------------------------------------------------------------- profile fields

def test_bad_behaviour_fields_are_refused():
    for kw, msg in ((dict(pad_tokens=48), "pad_tokens"), (dict(pad_tokens=-64), "pad_tokens"),
                    (dict(pad_tokens=True), "pad_tokens"), (dict(moe_dispatch="ring"),
                                                             "moe_dispatch"),
                    (dict(mixed_prefill="no"), "mixed_prefill")):
        with pytest.raises(NeuScaleError, match=msg):
            dataclasses.replace(NONE, **kw)
    with pytest.raises(NeuScaleError, match="mixed_prefill"):
        parse_stack('{"name": "x", "step_s": 0, "per_seq_s": 0, "request_s": 0, '
                    '"mixed_prefill": 1}')
    p = parse_stack('{"name": "x", "step_s": 0, "per_seq_s": 0, "request_s": 0, '
                    '"pad_tokens": 128, "moe_dispatch": "allgather", "mixed_prefill": false}')
    assert (p.pad_tokens, p.moe_dispatch, p.mixed_prefill) == (128, "allgather", False)
    # the built-in profiles: what the sources say
    s, v = get_stack("sglang-jax"), get_stack("vllm-tpu")
    assert (s.mixed_prefill, s.pad_tokens, s.moe_dispatch) == (False, 64, "allgather")
    assert (v.mixed_prefill, v.pad_tokens, v.moe_dispatch) == (True, 0, "a2a")
    for k in ("mixed_prefill", "pad_tokens", "moe_dispatch"):
        assert k in s.sources


def test_padding_rounds_the_busiest_ranks_tokens_times_the_ranks_to_a_power_of_two():
    pad = dataclasses.replace(NONE, name="pad", pad_tokens=64)
    assert pad.padded_prefill(500, 8) == 512        # 4000 -> 4096 over 8 ranks
    assert pad.padded_prefill(1000, 8) == 1024
    assert pad.padded_prefill(500, 1) == 512
    assert pad.padded_prefill(10, 1) == 64          # the smallest shape
    assert pad.padded_prefill(0, 8) == 0
    assert np.allclose(pad.padded_prefill(np.array([0, 64, 65]), 1), [0, 64, 128])
    assert NONE.padded_prefill(500, 8) == 62.5      # no padding: the even share


def test_padded_tokens_run_the_matmuls_but_not_attention():
    arch, cat = load_model("llama3-8b"), default_catalog()
    pad = dataclasses.replace(NONE, name="pad", pad_tokens=64)
    a = ChipModel.of(arch, cat, "v6e", "1x1", 1, stack=pad)
    b = ChipModel.of(arch, cat, "v6e", "1x1", 1, stack=NONE)
    padded = {o.name: o.time_s for o in a.mixed_step(300, 300 * 301 / 2, 0, 0, 1).ops}
    real = {o.name: o.time_s for o in b.mixed_step(300, 300 * 301 / 2, 0, 0, 1).ops}
    as512 = {o.name: o.time_s for o in b.mixed_step(512, 300 * 301 / 2, 0, 0, 1).ops}
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert padded[name] == pytest.approx(as512[name]) and padded[name] > real[name]
    flash = [n for n in real if n.startswith("attn_prefill")]
    assert flash and all(padded[n] == pytest.approx(real[n]) for n in flash)
    # the engines' step-cost table pads the same way
    ta, tb = StepCostTable(a), StepCostTable(b)
    for p in (300.0, 1000.0):
        ctx = p * (p + 1) / 2
        assert ta.step(p, ctx, 0.0, 0.0)[0] > tb.step(p, ctx, 0.0, 0.0)[0]
        assert ta.step(p, ctx, 0.0, 0.0)[0] == pytest.approx(ta.detailed(p, ctx, 0.0, 0.0)[0],
                                                             rel=0.05)
    assert ta.step(512.0, 512 * 513 / 2, 0.0, 0.0)[0] == pytest.approx(
        tb.step(512.0, 512 * 513 / 2, 0.0, 0.0)[0], rel=1e-9)      # a bucket's own size


def test_the_allgather_dispatch_sends_every_token_to_every_chip():
    arch, cat = load_model("deepseek-v3"), default_catalog()
    ag = dataclasses.replace(NONE, name="ag", moe_dispatch="allgather")
    a = ChipModel.of(arch, cat, "v6e", "8x8", 8, 1, 8, stack=ag)
    b = ChipModel.of(arch, cat, "v6e", "8x8", 8, 1, 8, stack=NONE)
    ra = {o.name: o for o in a.step("prefill", 8, 512).ops}
    rb = {o.name: o for o in b.step("prefill", 8, 512).ops}
    assert "dispatch_allgather" in ra and "combine_allreduce" in ra
    assert "dispatch_a2a" not in ra and "dispatch_a2a" in rb
    tokens, H = 8 * 512, arch.hidden
    # each chip receives the other groups' 7/8 of all the stage's tokens
    assert ra["dispatch_allgather"].ici_bytes == pytest.approx(7 / 8 * tokens * H * 2)
    # a2a sends each chip's tokens to their top-k experts' chips: less than gathering all
    assert rb["dispatch_a2a"].ici_bytes < ra["dispatch_allgather"].ici_bytes + \
        ra["combine_allreduce"].ici_bytes


# ---------------------------------------------------------------- prefill-first engines

def _mixed_run(mixed: bool):
    rec = Recorder(hand_cost())
    e = Engine(rec, max_batched_tokens=256, mixed_prefill=mixed)
    e.submit("a", 0.0, 32, 200)            # decoding when b arrives
    e.submit("b", 0.05, 600, 5)            # a prompt of 3 chunks of 256
    e.run_until_idle()
    return e, rec.flat()


def test_an_unmixed_engine_stalls_decodes_for_every_prefill_chunk():
    e, steps = _mixed_run(False)
    both = (steps[:, 0] > 0) & (steps[:, 2] > 0)
    assert not both.any()                   # no step prefills and decodes
    chunks = steps[steps[:, 0] > 0, 0]
    assert sorted(chunks.tolist()) == [32, 88, 256, 256]    # a's prompt, then b's in chunks
    m, msteps = _mixed_run(True)
    assert ((msteps[:, 0] > 0) & (msteps[:, 2] > 0)).any()   # vLLM: chunks ride with decodes
    fa, ma = e.requests["a"], m.requests["a"]
    assert fa.finish_s > ma.finish_s        # a waited out b's prefill steps
    assert all(r.finished for r in e.requests.values())     # nothing lost


def test_sim_bench_runs_the_stacks_scheduler():
    from sim.bench import BenchConfig, Lengths, Workload, run
    rows = {}
    for stack in ("sglang-jax", "vllm-tpu"):
        rows[stack] = run(BenchConfig(model="llama3-8b", chip="v6e", num_chips=1, tp=1,
                                      stack=stack, max_num_seqs=16, max_batched_tokens=512,
                                      workload=Workload.parse("closed:8"), requests=40,
                                      input_tokens=Lengths.parse("400-1200", "input"),
                                      output_tokens=Lengths.parse("50-200", "output"), seed=3))
    # the same prompts: under prefill-first steps a decode token waits out whole prefills
    assert rows["sglang-jax"]["tpot_p99_s"] > rows["vllm-tpu"]["tpot_p99_s"]
