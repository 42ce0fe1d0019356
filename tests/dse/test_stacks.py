"""Serving-stack profiles (dse/stacks.py): what they add to the roofline, the chip model and
the databases, and the errors around them."""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from dse.builder import DSE, Candidate
from dse.catalog import default_catalog
from dse.costmodel import Parallelism
from dse.errors import NeuScaleError
from dse.models import load_model
from dse.stacks import PROFILES, get_stack, stack_of
from dse.vpod import ICITopology
from sim.chip import ChipModel


def test_names_default_and_unknown():
    assert get_stack(None).name == "vllm-tpu"
    assert get_stack("SGLang-JAX").name == "sglang-jax"
    with pytest.raises(NeuScaleError, match="unknown serving stack 'trt'"):
        get_stack("trt")
    for p in PROFILES.values():          # every built-in constant is cited
        for k in ("step_s", "request_s"):
            assert getattr(p, k) == 0 or k in p.sources or p.name == "none", (p.name, k)


def test_bad_profile_values_are_refused():
    with pytest.raises(NeuScaleError, match="attn_decode_eff"):
        dataclasses.replace(get_stack("none"), attn_decode_eff=0.0)
    with pytest.raises(NeuScaleError, match="step_s"):
        dataclasses.replace(get_stack("none"), step_s=-1.0)


def _roofline_latency(stack, phase="decode", B=(1, 16, 64)):
    arch, cat = load_model("llama3-8b"), default_catalog()
    chip = cat.get("v6e")
    d = DSE(arch, cat, stack=stack)
    cand = Candidate(chip, ICITopology.parse("1x1").for_chip(chip), Parallelism(1, 1, 1))
    d.ensure_fits({cand.par}, workers=1, progress=False)
    r = d.evaluate(cand, phase, np.asarray(B), np.asarray([1024]))
    return r.latency_s[:, 0]


def test_roofline_adds_host_time_per_step_or_overlaps_it():
    none = get_stack("none")
    add = dataclasses.replace(none, name="add", step_s=2e-3, per_seq_s=1e-5)
    over = dataclasses.replace(add, overlap=True, step_s=1.0)
    base = _roofline_latency(none)
    assert np.allclose(_roofline_latency(add), base + 2e-3 + 1e-5 * np.array([1, 16, 64]))
    assert np.allclose(_roofline_latency(over), 1.0 + 1e-5 * np.array([1, 16, 64]))


def test_chip_model_stretches_only_the_attention_kernels():
    arch, cat = load_model("llama3-8b"), default_catalog()
    none = get_stack("none")
    half = dataclasses.replace(none, name="half", attn_decode_eff=0.5, attn_prefill_eff=0.25)
    a = ChipModel.of(arch, cat, "v6e", "1x1", 1, stack=none)
    b = ChipModel.of(arch, cat, "v6e", "1x1", 1, stack=half)
    for phase, eff in (("decode", 0.5), ("prefill", 0.25)):
        ra, rb = a.step(phase, 8, 2048), b.step(phase, 8, 2048)
        ta = {o.name: o.time_s for o in ra.ops}
        tb = {o.name: o.time_s for o in rb.ops}
        attn = [k for k in ta if k.startswith(f"attn_{phase}")]
        assert attn
        for k in ta:
            assert tb[k] == pytest.approx(ta[k] / eff if k in attn else ta[k]), k
        assert rb.latency_s > ra.latency_s
        # the same work: dynamic energy unchanged, static energy over the longer step
        static = b.hw.static_power_w * b.par.chips
        assert rb.energy_j - static * rb.latency_s == pytest.approx(
            ra.energy_j - static * ra.latency_s, rel=1e-9)


def test_database_records_its_stack_and_refuses_another(llama8b_db):
    db, path = llama8b_db
    assert db.stack.name == "vllm-tpu" and db.meta["stack"] == get_stack().to_json()
    meta = dict(db.meta, stack=dict(db.meta["stack"], step_s=0.123))
    with pytest.raises(NeuScaleError, match="other values of the 'vllm-tpu'"):
        stack_of(meta)
    with pytest.raises(NeuScaleError, match="records no serving stack"):
        stack_of({k: v for k, v in db.meta.items() if k != "stack"})


def test_simulate_stack_must_match_the_database(llama8b_db):
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "simulate", "--model",
                        "llama3-8b", "--db", str(llama8b_db[1]), "--trace", "azure-conv-2023",
                        "--hours", "0.01", "--stack", "sglang-jax"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error:"), p.stderr
    assert "contradicts --db" in p.stderr and p.stderr.count("\n") == 1


def test_a_stack_changes_the_database_cache_key():
    from sim.verified import cache_key
    arch, cat = load_model("llama3-8b"), default_catalog()
    keys = {cache_key(arch, "energy", 5.0, None, cat, s) for s in PROFILES}
    assert len(keys) == len(PROFILES)
    assert json.dumps(get_stack().to_json())


def test_parse_stack_takes_a_name_or_a_whole_json_profile():
    from dse.stacks import parse_stack
    assert parse_stack("jetstream").name == "jetstream" and parse_stack(None).name == "vllm-tpu"
    p = parse_stack('{"name": "slow", "step_s": 0.01, "per_seq_s": 0.001, "request_s": 0, '
                    '"overlap": true}')
    assert (p.name, p.step_s, p.per_seq_s, p.overlap) == ("slow", 0.01, 0.001, True)
    for bad, msg in (('{"name": "x"}', "missing"), ('{"step_s": 1}', "with a \\\"name\\\""),
                     ('{"name": "x", "step_s": 0, "per_seq_s": 0, "request_s": 0, "gpu": 1}',
                      "unknown field"),
                     ('{"name": "x", "step_s": 0, "per_seq_s": 0, "request_s": 0, '
                      '"overlap": "yes"}', "overlap"),
                     ('{"name": "x", "step_s": -1, "per_seq_s": 0, "request_s": 0}', "step_s"),
                     ("{oops", "not valid JSON"), ("trt", "unknown serving stack")):
        with pytest.raises(NeuScaleError, match=msg):
            parse_stack(bad)


def test_serve_refuses_a_bad_or_misplaced_engine_stack(tmp_path):
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "--engine-stack",
                        '{"name": "x"}', "--state", str(tmp_path / "s.db")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error:") and "missing" in p.stderr
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "--backend", "tpu",
                        "--engine-stack", "none", "--state", str(tmp_path / "s.db")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--engine-stack is for --backend sim" in p.stderr
