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


# ---- the on-disk table cache: key, damage, unwritable, file mode ---------------------------

def small(cache_dir, chip=None):
    c = chip or CAT.get("v6e")
    cm = ChipModel(load_model("llama3-8b"), c, ICITopology.parse("1x1").for_chip(c),
                   Parallelism(1))
    return StepCostTable(cm, cache_dir=cache_dir)


def arrays(tab):
    return [getattr(tab, k) for k in tab._NAMES]


def test_cache_key_covers_chip_spec_and_every_module_the_chip_model_runs():
    import ast
    import dataclasses
    from pathlib import Path

    import sim.chip
    from sim.stepcost import _KEY_MODULES
    ref = small(None)
    # a --chip-file that changes a chip's spec (same name) gets its own table
    other = dataclasses.replace(CAT.get("v6e"), hbm_bw_bytes_per_s=2000e9)
    assert small(None, other).cache_key() != ref.cache_key()
    assert small(None, dataclasses.replace(CAT.get("v6e"))).cache_key() == ref.cache_key()
    # every module of ours that sim.chip imports is hashed
    tree = ast.parse(Path(sim.chip.__file__).read_text())
    used = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
            and n.module.startswith("dse.")}
    used |= {f"sim.{n.module}" for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and n.level == 1}
    assert used - {"dse.errors"} <= set(_KEY_MODULES)


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """A table and its cache file, built once."""
    d = tmp_path_factory.mktemp("stepcost")
    tab = small(d)
    (path,) = d.glob("*.npz")
    return tab, path


def _rewrite(p, **over):
    with np.load(p) as z:
        d = {k: z[k] for k in z.files}
    np.savez(p, **{**d, **over})


DAMAGE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:300]),
    "empty": lambda p: p.write_bytes(b""),
    "wrong shape": lambda p: _rewrite(p, t_tok=np.ones(3)),
    "missing array": lambda p: np.savez(p, t_tok=np.ones(3)),
    "NaN": lambda p: _rewrite(p, e_head=np.full_like(np.load(p)["e_head"], np.nan)),
    "negative": lambda p: _rewrite(p, t_pre=-np.load(p)["t_pre"]),
    "x1000": lambda p: _rewrite(p, t_dec=1000 * np.load(p)["t_dec"]),
    "int dtype": lambda p: _rewrite(p, t_tok=np.load(p)["t_tok"].astype(np.int64)),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_table_is_rebuilt_and_said_once(tmp_path, capsys, cached, case):
    ref, src = cached
    path = tmp_path / src.name
    path.write_bytes(src.read_bytes())
    DAMAGE[case](path)
    capsys.readouterr()
    tab = small(tmp_path)
    for a, b in zip(arrays(tab), arrays(ref)):
        np.testing.assert_array_equal(a, b)
    small(tmp_path)                               # the rebuilt table was written back
    err = capsys.readouterr().err
    assert err.count("note: ") == 1 and "step-cost table" in err and "rebuilding" in err, err


def test_sound_cached_table_is_used(tmp_path, capsys, cached, monkeypatch):
    ref, src = cached
    (tmp_path / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(StepCostTable, "_tabulate", lambda self: pytest.fail("tabulated"))
    np.testing.assert_array_equal(small(tmp_path).t_pre, ref.t_pre)
    assert capsys.readouterr().err == ""


def test_table_path_that_is_a_directory(tmp_path, capsys, cached):
    ref, src = cached
    path = tmp_path / src.name
    path.mkdir()
    tab = small(tmp_path)
    np.testing.assert_array_equal(tab.t_dec, ref.t_dec)
    err = capsys.readouterr().err
    assert "not a regular file" in err and "warning: cannot write the step-cost cache" in err


def test_unwritable_table_cache_runs_uncached_with_one_warning(tmp_path, capsys, monkeypatch,
                                                              cached):
    ref, _ = cached
    root = tmp_path / "file"                      # NEUSCALE_CACHE_DIR naming a file
    root.write_text("")
    small(root / "stepcost", CAT.get("v5e"))
    assert small(root / "stepcost").t_tok.tolist() == ref.t_tok.tolist()
    assert capsys.readouterr().err.count("warning: cannot write the step-cost cache") == 1
    import sim.stepcost as sc

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(sc, "write_atomic", refuse)
    tab = small(tmp_path / "ro")
    assert tab.kv_capacity_tokens == ref.kv_capacity_tokens
    assert "Permission denied" in capsys.readouterr().err


def test_table_files_get_the_umask_mode(tmp_path):
    import os
    import stat
    old = os.umask(0o022)
    try:
        small(tmp_path)
    finally:
        os.umask(old)
    (path,) = tmp_path.glob("*")
    assert path.suffix == ".npz" and stat.S_IMODE(path.stat().st_mode) == 0o644
