"""Fuzzing the loaders of user files: random bytes, random JSON values in every field, missing
fields, extra nesting. Each input gives a NeuScaleError or a sound result - never another
exception, never more than a couple of seconds (hypothesis' deadline)."""
import json
import math
from datetime import timedelta
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dse import NeuScaleError
from dse.catalog import Catalog, ChipSpec, chip_from_mapping, default_catalog, load_chip_file
from dse.models import DENSE_TYPES, ModelArch, arch_from_config, load_model

FUZZ = settings(max_examples=150, deadline=timedelta(seconds=2), derandomize=True,
                database=None, suppress_health_check=[HealthCheck.too_slow])
PRESETS = {n: json.loads(resources.files("dse.presets").joinpath(f"{n}.json").read_text())
           for n in ("llama3-8b", "deepseek-v3")}
CHIP = {**{k: v for k, v in default_catalog().get("v6e").to_json().items()
           if k != "static_power_w"}, "name": "npu-f", "aliases": ["NPU-F"]}
OVERRIDE = {**CHIP, "name": "v6e", "aliases": ["NPU-D"], "override": True}

scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4)
                      | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)


@st.composite
def mutated(draw, base: dict):
    """``base`` with some fields replaced by random values (often numbers near the real ones),
    deleted, or wrapped in extra nesting, and a few random fields added."""
    d = dict(base)
    for k in draw(st.lists(st.sampled_from(sorted(base)), max_size=5, unique=True)):
        how = draw(st.integers(0, 4))
        v = d[k]
        if how == 0:
            del d[k]
        elif how == 1:
            d[k] = draw(values)
        elif how == 2:
            d[k] = [v] if draw(st.booleans()) else {"value": v}
        elif how == 3 and isinstance(v, (int, float)) and not isinstance(v, bool):
            d[k] = draw(st.sampled_from([-v, 0, v + 1, v - 1, v * 1.5, v / 3, 2 * v, 1, 3]))
        else:
            d[k] = draw(scalars)
    if draw(st.integers(0, 7)) == 0:
        d.update(draw(st.dictionaries(st.text(max_size=8), values, min_size=1, max_size=2)))
    return d


def check_arch(a: ModelArch) -> None:
    ints = [a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.head_dim, a.vocab]
    assert all(type(x) is int and x >= 1 for x in ints)
    assert type(a.max_context) is int and a.max_context >= 0
    assert 0 <= a.first_dense_layers <= a.layers and a.dense_layers + a.moe_layers == a.layers
    if a.is_moe:
        assert 1 <= a.experts_per_token <= a.n_routed_experts and a.n_shared_experts >= 0
        assert a.qk_rope_head_dim % 2 == 0 and a.kv_lora_rank >= 1
    else:
        assert a.heads % a.kv_heads == 0 and a.head_dim % 2 == 0
    assert a.total_params() > 0 and a.kv_bytes_per_token() > 0
    assert ModelArch(**a.to_json()) == a


def config_or_error(cfg) -> None:
    try:
        a = arch_from_config(cfg, "fuzz")
    except NeuScaleError:
        return
    check_arch(a)


@FUZZ
@given(cfg=st.sampled_from(sorted(PRESETS)).flatmap(lambda n: mutated(PRESETS[n])))
def test_model_config_fields(cfg):
    config_or_error(cfg)


@FUZZ
@given(cfg=values | st.dictionaries(st.sampled_from(sorted(PRESETS["deepseek-v3"])), values)
       .map(lambda d: {**d, "model_type": sorted(DENSE_TYPES)[len(d) % 4]}))
def test_model_config_random_values(cfg):
    config_or_error(cfg)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _file(d: Path, data: bytes, name: str) -> Path:
    p = d / name
    p.write_bytes(data)
    return p


@FUZZ
@given(data=st.binary(max_size=400)
       | st.sampled_from(sorted(PRESETS)).flatmap(lambda n: mutated(PRESETS[n]))
       .map(lambda c: json.dumps(c).encode()))
def test_model_config_files(scratch, data):
    try:
        a = load_model(str(_file(scratch, data, "config.json")))
    except NeuScaleError:
        return
    check_arch(a)


def check_chip(c: ChipSpec) -> None:
    c.validate()
    assert all(isinstance(n, str) and n for n in c.all_names)
    assert math.isfinite(c.static_power_w) and c.e_flop_j > 0 and c.e_hbm_j_per_byte > 0
    Catalog([c]).get(c.name)


chips = mutated(CHIP) | mutated(OVERRIDE)


@FUZZ
@given(d=mutated(CHIP) | mutated(OVERRIDE) | values)
def test_chip_entries(d):
    try:
        c = chip_from_mapping(d)
    except NeuScaleError:
        return
    check_chip(c)


@FUZZ
@given(data=st.binary(max_size=400) | chips.map(lambda d: json.dumps(d).encode())
       | st.lists(chips, max_size=3).map(lambda x: json.dumps({"chips": x}).encode()),
       suffix=st.sampled_from([".json", ".yaml"]))
def test_chip_files(scratch, data, suffix):
    f = _file(scratch, data, "chips" + suffix)
    try:
        chips = load_chip_file(f)
        cat = default_catalog([f])
    except NeuScaleError:
        return
    for c in chips:
        check_chip(c)
        assert cat.get(c.name) == c
