"""Bad input, damaged caches, wrong files: one clear NeuScaleError for what a user can get
wrong, a rebuild for a damaged cache entry, one warning for a cache that cannot be written."""
import json
import os
import stat
import subprocess
import sys
import textwrap
from importlib import resources
from pathlib import Path

import pytest

from dse import NeuScaleError, default_catalog, load_chip_file
from dse.catalog import chip_from_mapping
from dse.models import arch_from_config, load_model
from dse.xla_cost import (COMPONENT_BASIS, FIT_POINTS, ComponentFit, FitCache, ShardDims,
                          analytic_matmul_flops, fit_key, fit_poly)

ROOT = Path(__file__).resolve().parents[2]


def preset(name):
    return json.loads(resources.files("dse.presets").joinpath(f"{name}.json").read_text())


# ---- A. model configs -------------------------------------------------------------------------

@pytest.mark.parametrize("model,over,msg", [
    ("deepseek-v3", {"first_k_dense_replace": -3},
     r"first_k_dense_replace must be from 0 to 61 \(num_hidden_layers\) \(got -3\)"),
    ("deepseek-v3", {"first_k_dense_replace": 62}, "first_k_dense_replace must be from 0 to 61"),
    ("deepseek-v3", {"n_shared_experts": -1}, "n_shared_experts must be from 0"),
    ("deepseek-v3", {"num_experts_per_tok": 300}, r"to 256 \(n_routed_experts\)"),
    ("deepseek-v3", {"qk_rope_head_dim": 63}, "qk_rope_head_dim .63. must be even"),
    ("deepseek-v3", {"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported"),
    ("deepseek-v3", {"kv_lora_rank": 0}, "kv_lora_rank must be from 1"),
    ("llama3-8b", {"hidden_size": 4100}, "hidden_size .4100. is not a multiple of "
     "num_attention_heads .32.: fix one of them or give head_dim"),
    ("llama3-8b", {"hidden_size": 4096.5}, "hidden_size must be a whole number.*not 4096.5"),
    ("llama3-8b", {"hidden_size": "4096"}, "hidden_size must be a whole number.*not the string"),
    ("llama3-8b", {"hidden_size": True}, "hidden_size must be a whole number.*boolean true"),
    ("llama3-8b", {"hidden_size": [4096]}, "hidden_size must be a whole number.*not a list"),
    ("llama3-8b", {"hidden_size": None}, "hidden_size is null"),
    ("llama3-8b", {"hidden_size": float("nan")}, "hidden_size must be .*not NaN"),
    ("llama3-8b", {"vocab_size": float("inf")}, "vocab_size must be .*not Infinity"),
    ("llama3-8b", {"vocab_size": 10 ** 30}, "vocab_size must be from 1 to 16,777,216"),
    ("llama3-8b", {"num_attention_heads": 0}, "num_attention_heads must be from 1"),
    ("llama3-8b", {"num_key_value_heads": 5}, r"num_attention_heads \(32\) must be a multiple "
     r"of num_key_value_heads \(5\)"),
    ("llama3-8b", {"num_key_value_heads": 64}, r"to 32 \(num_attention_heads\)"),
    ("llama3-8b", {"head_dim": 127}, r"head_dim \(127\) must be even"),
    ("llama3-8b", {"hidden_size": 96}, r"head_dim \(3\) must be even"),
    ("llama3-8b", {"max_position_embeddings": -1}, "max_position_embeddings must be from 1"),
    ("llama3-8b", {"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ("llama3-8b", {"model_type": ["llama"]}, "model_type must be a string, not a list"),
    ("llama3-8b", {"intermediate_size": {"a": 1}}, "intermediate_size .*not an object"),
])
def test_impossible_model_config_values_are_refused(model, over, msg):
    cfg = dict(preset(model), **over)
    with pytest.raises(NeuScaleError, match=msg):
        arch_from_config(cfg, "m", origin="cfg.json")


def test_model_config_not_a_mapping():
    with pytest.raises(NeuScaleError, match="must be a JSON object, not a list"):
        arch_from_config([1, 2], "m")


def test_valid_model_config_spellings_give_the_same_model():
    """null optional keys mean "not set" (as Hugging Face writes them); 4096.0 is 4096; an
    explicit head_dim lifts the divisibility rule."""
    base = arch_from_config(preset("llama3-8b"), "m")
    same = arch_from_config(dict(preset("llama3-8b"), hidden_size=4096.0, head_dim=None,
                                 tie_word_embeddings=None), "m")
    assert same == base and same.fingerprint() == base.fingerprint()
    assert isinstance(same.hidden, int)
    assert arch_from_config(dict(preset("llama3-8b"), num_key_value_heads=None), "m").kv_heads == 32
    odd = arch_from_config(dict(preset("llama3-8b"), hidden_size=4100, head_dim=128), "m")
    assert odd.head_dim == 128
    ds = arch_from_config(dict(preset("deepseek-v3"), q_lora_rank=None, n_shared_experts=None),
                          "m")
    assert ds.q_lora_rank == 0 and ds.n_shared_experts == 0


def test_model_config_files_that_are_not_configs(tmp_path):
    with pytest.raises(NeuScaleError, match="'/dev/zero' is not a regular file"):
        load_model("/dev/zero")
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").mkdir()
    with pytest.raises(NeuScaleError, match="is a directory"):
        load_model(str(d))
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"model_type": "llama\xe9"}')
    with pytest.raises(NeuScaleError, match="is not UTF-8 text"):
        load_model(str(bad))
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:
        fh.truncate(17 << 20)                      # sparse: no disk used
    with pytest.raises(NeuScaleError, match="larger than any real one .limit 16 MiB"):
        load_model(str(huge))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    with pytest.raises(NeuScaleError, match="is not valid JSON"):
        load_model(str(deep))
    big_int = tmp_path / "bigint.json"
    big_int.write_text('{"hidden_size": ' + "9" * 5000 + "}")
    with pytest.raises(NeuScaleError, match="is not valid JSON"):
        load_model(str(big_int))
    with pytest.raises(NeuScaleError, match="unknown model ''"):
        load_model("")


def cli(*argv):
    from orchestrator.cli import main
    return main(list(argv))


def test_model_cli_names_the_problem(tmp_path, capsys):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(dict(preset("deepseek-v3"), first_k_dense_replace=-3)))
    assert cli("dse", "cost", "--model", str(f), "--chip", "v5p", "--tp", "8", "--phase",
               "decode", "--batch", "1", "--seq-len", "128") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "first_k_dense_replace must be from 0 to 61" in err


# ---- B. chip files ----------------------------------------------------------------------------

def spec(**over):
    d = default_catalog().get("v6e").to_json()
    d.pop("static_power_w")
    d.update({"name": "npu-x", "aliases": ["NPU-X"], **over})
    return d


def write(tmp_path, obj, name="chips.json"):
    f = tmp_path / name
    f.write_text(json.dumps(obj))
    return f


def test_chip_file_cannot_silently_replace_a_builtin(tmp_path):
    f = write(tmp_path, spec(name="v6e", aliases=[], price_usd_per_chip_hour=1.0))
    with pytest.raises(NeuScaleError, match="chip 'v6e' is already in the catalog.*"
                                            "override: true"):
        default_catalog([f])
    assert default_catalog().get("v6e").price_usd_per_chip_hour == 2.70


def test_override_replaces_a_builtin_in_place(tmp_path):
    f = write(tmp_path, spec(name="v6e", aliases=["NPU-D", "trillium"], override=True,
                             price_usd_per_chip_hour=1.0))
    cat = default_catalog([f])
    assert cat.names() == ["v4", "v5e", "v5p", "v6e"]
    assert cat.get("NPU-D").price_usd_per_chip_hour == 1.0
    assert cat.fingerprint() != default_catalog().fingerprint()
    # the replaced chip's aliases go with it unless the entry keeps them
    cat = default_catalog([write(tmp_path, spec(name="v6e", aliases=[], override=True))])
    with pytest.raises(NeuScaleError, match="unknown chip 'tpu-v6e'"):
        cat.get("tpu-v6e")


@pytest.mark.parametrize("over,msg", [
    ({"override": True}, "chip 'npu-x' says override: true, but there is no chip of that name"),
    ({"name": "NPU-D", "override": True}, "'NPU-D' is an alias of chip 'v6e': name the chip "
                                          "'v6e' to replace it"),
    ({"override": "yes"}, "override must be true or false"),
    ({"name": ""}, "name must be 1-64 letters"),
    ({"name": 5}, r"name must be .* \(got 5\)"),
    ({"name": "a,b"}, "name must be 1-64 letters"),
    ({"name": "v6e:2x2"}, "name must be 1-64 letters"),
    ({"aliases": ["ok", 3]}, r"each alias must be .* \(got 3\)"),
    ({"aliases": {"a": 1}}, "aliases must be a list of names"),
    ({"aliases": ["NPU-C"]}, "alias 'NPU-C' is already used by chip 'v5p'"),
    ({"hbm_bytes": True}, r"hbm_bytes must be a positive number \(got true\)"),
    ({"price_usd_per_chip_hour": "2.7"}, "price_usd_per_chip_hour must be a positive number"),
    ({"peak_flops_per_s": float("nan")}, r"peak_flops_per_s must be a positive number \(got nan"),
    ({"hbm_bw_bytes_per_s": 0}, "hbm_bw_bytes_per_s must be a positive number"),
    ({"sram_bytes": -1.0}, "sram_bytes must be a positive number"),
    ({"static_power_w": float("nan")}, "static_power_w must be a number >= 0"),
    ({"static_power_w": -5}, "static_power_w must be a number >= 0"),
    ({"static_power_w": "70"}, "static_power_w must be a number >= 0 .got '70'"),
    ({"systolic_width": True}, "systolic_width must be a positive integer"),
    ({"chips_per_host": 8.0}, "chips_per_host must be a positive integer"),
    ({"torus_dims": 2.0}, "torus_dims must be 2 or 3"),
    ({"max_dim_chips": 10 ** 12}, "max_dim_chips must be a positive integer of at most 65,536"),
    ({"max_dim_chips": 24}, "max_dim_chips must be a power of two"),
    ({"hbm_type": ""}, "hbm_type must be a non-empty string"),
    ({"accelerator_count_unit": ["chips"]}, "accelerator_count_unit must be 'cores' or 'chips'"),
    ({"sources": "Table 2"}, "sources must map topics to source strings"),
])
def test_bad_chip_entries_name_the_field(tmp_path, over, msg):
    with pytest.raises(NeuScaleError, match=msg):
        default_catalog([write(tmp_path, spec(**over))])


def test_chip_aliases_and_duplicates(tmp_path):
    cat = default_catalog([write(tmp_path, spec(aliases="NPU-X"))])   # a string: one alias
    assert cat.get("npu-x").aliases == ("NPU-X",) and cat.get("NPU-X").name == "npu-x"
    with pytest.raises(NeuScaleError, match="unknown chip 'N'"):
        cat.get("N")
    assert default_catalog([write(tmp_path, spec(aliases=None))]).get("npu-x").aliases == ()
    two = write(tmp_path, {"chips": [spec(price_usd_per_chip_hour=1.0), spec()]})
    with pytest.raises(NeuScaleError, match="defines chip 'npu-x' twice"):
        default_catalog([two])
    a, b = write(tmp_path, spec(), "a.json"), write(tmp_path, spec(aliases=[]), "b.json")
    with pytest.raises(NeuScaleError, match="chip 'npu-x' is defined twice, in .*a.json"):
        default_catalog([a, b])
    with pytest.raises(NeuScaleError, match="alias 'npu-x' is already used by chip 'npu-x'"):
        default_catalog([write(tmp_path, {"chips": [spec(), spec(name="npu-y",
                                                                 aliases=["npu-x"])]})])


def test_chip_files_that_are_not_chip_files(tmp_path):
    with pytest.raises(NeuScaleError, match="'/dev/zero' is not a regular file"):
        load_chip_file("/dev/zero")
    with pytest.raises(NeuScaleError, match="is a directory"):
        load_chip_file(tmp_path)
    bad = tmp_path / "chip.yaml"
    bad.write_bytes(b"name: npu-\xff\n")
    with pytest.raises(NeuScaleError, match="is not UTF-8 text"):
        load_chip_file(bad)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:
        fh.truncate(17 << 20)
    with pytest.raises(NeuScaleError, match="larger than any real one"):
        load_chip_file(huge)
    with pytest.raises(NeuScaleError, match="holds no chips"):
        load_chip_file(write(tmp_path, {"chips": []}))
    with pytest.raises(NeuScaleError, match="'chips' must be a list"):
        load_chip_file(write(tmp_path, {"chips": spec()}))
    with pytest.raises(NeuScaleError, match="unexpected key 'name' beside 'chips'"):
        load_chip_file(write(tmp_path, {"chips": [spec()], "name": "x"}))
    keys = tmp_path / "keys.yaml"
    keys.write_text("1: a\nname: npu-x\n")
    with pytest.raises(NeuScaleError, match="field names must be strings"):
        load_chip_file(keys)
    with pytest.raises(NeuScaleError, match="must hold a chip object"):
        load_chip_file(write(tmp_path, [spec(), 3]))
    # a database's catalog snapshot still loads (dse.plot reads it back)
    v5p = default_catalog().get("v5p")
    assert chip_from_mapping(v5p.to_json(), origin="database catalog") == v5p


def test_chip_cli_names_the_problem(tmp_path, capsys):
    f = write(tmp_path, spec(name="v6e", aliases=[]))
    assert cli("dse", "cost", "--model", "llama3-8b", "--chip", "v6e", "--tp", "1", "--phase",
               "decode", "--batch", "1", "--seq-len", "128", "--chip-file", str(f)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "override: true" in err


# ---- C-F. the XLA-fit cache -------------------------------------------------------------------

def fake_fit(arch, comp, tp, ep=1):
    """A sound fit without JAX: the polynomial through the matmul hand count."""
    d = ShardDims.of(arch, tp, ep)
    pts = FIT_POINTS[comp]
    coef = fit_poly(COMPONENT_BASIS[comp], pts, [analytic_matmul_flops(d, comp, p) for p in pts])
    return ComponentFit(fit_key(comp, tp, ep), comp, COMPONENT_BASIS[comp],
                        tuple(map(float, coef)), tuple(map(float, coef)), 1e-7, 0.0)


@pytest.fixture
def arch():
    return load_model("llama3-8b")


def saved(arch, directory, keys):
    c = FitCache(arch, directory)
    for comp, tp in keys:
        f = fake_fit(arch, comp, tp)
        c.fits[f.key] = f
    c.save()
    return c


def test_fit_cache_key_covers_graph_and_jax_versions(arch, tmp_path, monkeypatch):
    import dse.xla_cost as xc
    c = saved(arch, tmp_path, [("mlp", 2)])
    assert c.graph_version in c.path.name and arch.fingerprint() in c.path.name
    assert FitCache(arch, tmp_path).fits.keys() == {"mlp|tp=2"}
    # the graph version hashes this module's source, JAX and jaxlib
    v = xc.graph_version.__wrapped__
    monkeypatch.setattr(xc, "_pkg_version", lambda n: "9.9" if n == "jaxlib" else "0.10.2")
    assert v() != c.graph_version
    monkeypatch.undo()
    monkeypatch.setattr(xc, "graph_version", lambda: "0ther")
    assert FitCache(arch, tmp_path).fits == {}            # another graph: nothing reused
    # a file whose content says another graph version is not trusted either
    monkeypatch.undo()
    blob = json.loads(c.path.read_text())
    c.path.write_text(json.dumps(dict(blob, graph_version="0ther")))
    assert FitCache(arch, tmp_path).fits == {}


@pytest.mark.parametrize("damage,why", [
    (lambda b: [], "not a JSON object"),
    (lambda b: dict(b, fits=[]), "'fits' is not an object"),
    (lambda b: "{trunc", "not valid JSON"),
    (lambda b: {**b, "fits": {"mlp|tp=2": {**b["fits"]["mlp|tp=2"], "flops": "abc"}}},
     "flops is not a list of 2 finite numbers"),
    (lambda b: {**b, "fits": {"mlp|tp=2": {**b["fits"]["mlp|tp=2"],
                                           "flops": [float("nan"), 0.0]}}}, "finite"),
    (lambda b: {**b, "fits": {"mlp|tp=2": {**b["fits"]["mlp|tp=2"], "flops": [
        1000 * x for x in b["fits"]["mlp|tp=2"]["flops"]]}}}, "off the matmul hand count"),
    (lambda b: {**b, "fits": {"mlp|tp=2": {**b["fits"]["mlp|tp=2"], "flops": [
        -x for x in b["fits"]["mlp|tp=2"]["flops"]]}}}, "negative count"),
    (lambda b: {**b, "fits": {"mlp|tp=2": {**b["fits"]["mlp|tp=2"], "component": "lm_head"}}},
     "does not name a fit"),
    (lambda b: {**b, "fits": {"mlp|tp=2": {**b["fits"]["mlp|tp=2"], "basis": [[2], [0]]}}},
     "basis differs"),
])
def test_damaged_fit_cache_is_rebuilt_and_said_once(arch, tmp_path, capsys, damage, why):
    c = saved(arch, tmp_path, [("mlp", 2)])
    bad = damage(json.loads(c.path.read_text()))
    c.path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    capsys.readouterr()
    assert FitCache(arch, tmp_path).missing([("mlp", 2, 1)]) == [("mlp", 2, 1)]
    FitCache(arch, tmp_path)
    err = capsys.readouterr().err
    assert err.count("note: ") == 1 and "damaged (" in err and why in err, err
    saved(arch, tmp_path, [("mlp", 2)])                 # the next save repairs the file
    assert FitCache(arch, tmp_path).missing([("mlp", 2, 1)]) == []


def test_fit_cache_that_is_a_directory(arch, tmp_path, capsys):
    c = FitCache(arch, tmp_path)
    c.path.mkdir()
    c = saved(arch, tmp_path, [("mlp", 2)])             # no exception: runs uncached
    assert "mlp|tp=2" in c.fits
    err = capsys.readouterr().err
    assert "is a directory" in err and err.count("warning: cannot write the XLA-fit cache") == 1


def test_unwritable_fit_cache_runs_uncached_with_one_warning(arch, tmp_path, monkeypatch,
                                                             capsys):
    root = tmp_path / "not-a-dir"
    root.write_text("")
    monkeypatch.setenv("NEUSCALE_CACHE_DIR", str(root))
    c = saved(arch, None, [("mlp", 2)])
    c.save()
    saved(arch, None, [("mlp", 4)])
    assert c.fits.keys() == {"mlp|tp=2"}
    assert capsys.readouterr().err.count("warning: cannot write the XLA-fit cache") == 1
    # read-only (as root, chmod does not stop writes: make the write fail instead)
    import dse.xla_cost as xc

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(xc, "write_atomic", refuse)
    saved(arch, tmp_path / "ro", [("mlp", 2)])
    err = capsys.readouterr().err
    assert "Permission denied" in err and "running uncached" in err


def test_cache_files_get_the_umask_mode(arch, tmp_path):
    old = os.umask(0o022)
    try:
        c = saved(arch, tmp_path / "missing" / "dir", [("mlp", 2)])   # created on the way
    finally:
        os.umask(old)
    assert stat.S_IMODE(c.path.stat().st_mode) == 0o644
    assert [p.name for p in c.path.parent.iterdir() if p.name.startswith(".tmp-")] == []


def test_two_caches_merge_instead_of_dropping_each_others_fits(arch, tmp_path):
    a, b = FitCache(arch, tmp_path), FitCache(arch, tmp_path)   # both read an empty cache
    fa, fb = fake_fit(arch, "mlp", 2), fake_fit(arch, "lm_head", 2)
    a.fits[fa.key] = fa
    a.save()
    b.fits[fb.key] = fb
    b.save()                                           # used to overwrite a's fit
    assert FitCache(arch, tmp_path).fits == {fa.key: fa, fb.key: fb}
    assert b.fits == {fb.key: fb}                      # a run reports only its own fits


def test_two_processes_saving_at_once_lose_nothing(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_bad_input import fake_fit
        from dse.models import load_model
        from dse.xla_cost import FitCache
        arch, comp = load_model("llama3-8b"), sys.argv[1]
        for tp in range(1, 31):
            c = FitCache(arch, {str(tmp_path)!r})
            f = fake_fit(arch, comp, tp)
            c.fits[f.key] = f
            c.save()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, comp], cwd=ROOT)
             for comp in ("mlp", "lm_head")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    fits = FitCache(load_model("llama3-8b"), tmp_path).fits
    assert len(fits) == 60
