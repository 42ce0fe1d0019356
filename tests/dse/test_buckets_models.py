import json

import pytest

from dse import BATCH_BUCKETS, PRESETS, SEQ_BUCKETS, NeuScaleError, bucket_index, bucket_of
from dse.models import load_model


def test_48_buckets_with_paper_increments():
    assert len(SEQ_BUCKETS) == 48
    assert SEQ_BUCKETS[:8] == (128, 256, 384, 512, 640, 768, 896, 1024)
    assert SEQ_BUCKETS[8:12] == (1280, 1536, 1792, 2048)          # 256-token steps
    assert SEQ_BUCKETS[12:16] == (2560, 3072, 3584, 4096)         # 512-token steps
    assert SEQ_BUCKETS[-1] == 1 << 20


@pytest.mark.parametrize("n,edge", [(1, 128), (128, 128), (129, 256), (1024, 1024),
                                    (1025, 1280), (2048, 2048), (2049, 2560),
                                    (1048575, 1048576), (1048576, 1048576)])
def test_bucket_edges(n, edge):
    assert bucket_of(n) == edge
    assert SEQ_BUCKETS[bucket_index(n)] == edge


@pytest.mark.parametrize("bad", [0, -5, 1048577, "abc"])
def test_bad_lengths(bad):
    with pytest.raises(NeuScaleError):
        bucket_index(bad)


def test_batch_buckets():
    assert BATCH_BUCKETS[:6] == (1, 2, 4, 8, 16, 32)
    assert BATCH_BUCKETS[-1] == 1024 and len(BATCH_BUCKETS) == 68
    assert all(b % 16 == 0 for b in BATCH_BUCKETS[4:])


@pytest.mark.parametrize("name,params_b", [("llama3-8b", 8.03), ("llama3-70b", 70.55),
                                           ("llama3.1-405b", 405.85), ("deepseek-v3", 671.03)])
def test_preset_parameter_counts_match_published_sizes(name, params_b):
    a = load_model(name)
    assert a.total_params() / 1e9 == pytest.approx(params_b, abs=0.02)


def test_model_structure():
    ds = load_model("deepseek-v3")
    assert ds.is_moe and ds.layer_kinds()[:4] == ["dense"] * 3 + ["moe"]
    assert ds.kv_elems_per_token_per_layer() == 512 + 64          # MLA latent + rope key
    l70 = load_model("llama3-70b")
    assert l70.kv_elems_per_token_per_layer(1) == 2 * 8 * 128      # GQA: KV heads only
    assert l70.kv_elems_per_token_per_layer(16) == 2 * 1 * 128     # replicated past 8 ranks


def test_config_path_and_errors(tmp_path):
    cfg = json.loads((load_model.__globals__["resources"].files("dse.presets")
                      / "llama3-8b.json").read_text())
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(d)).name == "my-model"
    assert load_model(str(d / "config.json")).total_params() == load_model("llama3-8b").total_params()
    with pytest.raises(NeuScaleError, match="unknown model 'gpt-9'.*llama3-8b"):
        load_model("gpt-9")
    bad = dict(cfg, model_type="mamba")
    (d / "config.json").write_text(json.dumps(bad))
    with pytest.raises(NeuScaleError, match="model_type 'mamba' is not supported"):
        load_model(str(d))
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NeuScaleError, match="lacks 'hidden_size'"):
        load_model(str(d))
    assert set(PRESETS) == {"llama3-8b", "llama3-70b", "llama3.1-405b", "deepseek-v3"}
