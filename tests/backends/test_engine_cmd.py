"""The vLLM command lines of a vPod, the Cloud TPU slice it maps to, and the cluster config's
errors (backends/engine.py, backends/tpu.py, backends/config.py, backends/static.py)."""
import shlex

import pytest

from backends.base import ConfigError, VPodSpec
from backends.engine import EngineSettings, engine_env, host_plan, secret_env, vllm_argv
from backends.tpu import TpuSettings, cloud_error, slice_for
from dse.catalog import default_catalog


def spec(**kw) -> VPodSpec:
    d = dict(id="c-d0001-abcd", group="g", phase="decode", model="llama3-70b", chip="v5p",
             topology="2x2x1", num_chips=4, tp=4, pp=1, ep=1, max_batch=96,
             max_model_len=8192, labels={"neuscale-cluster": "c"})
    d.update(kw)
    return VPodSpec(**d)


def test_vllm_argv_carries_the_allocation():
    s = EngineSettings(model="meta-llama/Meta-Llama-3-70B", served_model_name="llama3-70b")
    a = vllm_argv(spec(), s)
    assert a[:3] == ["vllm", "serve", "meta-llama/Meta-Llama-3-70B"]
    j = " ".join(a)
    for part in ("--tensor-parallel-size 4", "--pipeline-parallel-size 1", "--max-num-seqs 96",
                 "--max-model-len 8192", "--served-model-name llama3-70b", "--port 8000",
                 "--max-num-batched-tokens 8192"):    # the budget the simulated engines run
        assert part in j
    small = EngineSettings.from_mapping({"model": "m", "max-num-batched-tokens": 2048})
    assert "--max-num-batched-tokens 2048" in " ".join(vllm_argv(spec(), small))
    # never below the sequences a step may hold (vLLM refuses that)
    tiny = EngineSettings.from_mapping({"model": "m", "max_num_batched_tokens": 16})
    assert "--max-num-batched-tokens 96" in " ".join(vllm_argv(spec(), tiny))
    for bad in (0, "many", 1.5):
        with pytest.raises(ConfigError, match="max_num_batched_tokens"):
            EngineSettings.from_mapping({"model": "m", "max_num_batched_tokens": bad})
    assert "--enable-expert-parallel" not in a
    # experts: data-parallel attention over ep, experts over all chips; batch per DP rank
    e = vllm_argv(spec(num_chips=16, topology="2x2x4", tp=4, ep=4, max_batch=250,
                       attn="hybrid"), s)
    je = " ".join(e)
    assert "--data-parallel-size 4" in je and "--enable-expert-parallel" in e
    assert "--max-num-seqs 63" in je


def test_multi_host_runs_ray_and_the_engine_on_worker_0():
    s = EngineSettings(model="gs://bucket/llama", served_model_name="m")
    plan = host_plan(spec(num_chips=8, topology="2x2x2", tp=8), ["10.0.0.1", "10.0.0.2"], s)
    assert [h for h, _, _ in plan] == ["10.0.0.1", "10.0.0.2", "10.0.0.1"]
    assert plan[0][2][:3] == ["ray", "start", "--head"]
    assert "--address=10.0.0.1:6379" in plan[1][2]
    assert plan[2][2][-2:] == ["--distributed-executor-backend", "ray"]
    assert plan[2][2][2].startswith("~/.neuscale/weights/")      # copied from GCS first


def test_awkward_values_survive_quoting_and_secrets_stay_out_of_argv():
    s = EngineSettings(model="/models/my model's dir; rm -rf /", served_model_name="m",
                       extra_args=("--chat-template", "a b \"c\" $HOME `x`"),
                       api_key_env="K")
    a = vllm_argv(spec(), s)
    assert shlex.split(shlex.join(a)) == a
    sec = secret_env(s, {"K": "sekret", "HF_TOKEN": "hf_x"})
    assert sec == {"VLLM_API_KEY": "sekret", "HF_TOKEN": "hf_x"}
    assert not any("sekret" in x for x in a)
    with pytest.raises(ConfigError, match="K is not set"):
        secret_env(s, {})


def test_a_sub_host_vpod_sees_only_its_chips():
    env = engine_env(spec(num_chips=1, topology="1x1x1", tp=1), EngineSettings(model="x"), 4)
    assert env["TPU_VISIBLE_CHIPS"] == "0" and env["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert "TPU_VISIBLE_CHIPS" not in engine_env(spec(), EngineSettings(model="x"), 4)


@pytest.mark.parametrize("chip,topo,n,want,hosts", [
    ("v6e", "1x1", 1, "1x1", 1), ("v6e", "2x1", 2, "2x2", 1), ("v6e", "4x2", 8, "2x4", 1),
    ("v6e", "4x4", 16, "4x4", 2), ("v5e", "16x16", 256, "16x16", 32),
    ("v5p", "1x1x1", 1, "2x2x1", 1), ("v5p", "2x2x2", 8, "2x2x2", 2),
    ("v5p", "4x2x1", 8, "2x2x2", 2), ("v4", "4x4x4", 64, "4x4x4", 16)])
def test_slices_cloud_tpu_sells(chip, topo, n, want, hosts):
    c = default_catalog().get(chip)
    sl = slice_for(chip, topo, n, c.chips_per_host)
    assert (sl.topology, sl.hosts) == (want, hosts) and sl.num_chips >= n


def test_config_errors_name_the_setting():
    with pytest.raises(ConfigError, match="tpu.project"):
        TpuSettings.from_mapping({"zones": {"v6e": ["us-east5-b"]}})
    with pytest.raises(ConfigError, match="tpu.zones"):
        TpuSettings.from_mapping({"project": "p", "zones": {"v6e": ["nowhere"]}})
    with pytest.raises(ConfigError, match="unknown chip version"):
        TpuSettings.from_mapping({"project": "p", "zones": {"v9": ["us-east5-b"]}})
    with pytest.raises(ConfigError, match="unknown setting 'projet'"):
        TpuSettings.from_mapping({"projet": "p", "project": "p", "zones": {}})
    with pytest.raises(ConfigError, match="provisioning"):
        TpuSettings.from_mapping({"project": "p", "zones": {"v6e": "us-east5-b"},
                                  "provisioning": "maybe"})
    with pytest.raises(ConfigError, match="engine.port"):
        EngineSettings.from_mapping({"port": 0})
    with pytest.raises(ConfigError, match="secret"):
        EngineSettings.from_mapping({"env": {"VLLM_API_KEY": "x"}})
    from backends.static import parse_hosts
    with pytest.raises(ConfigError, match=r"hosts\[0\]"):
        parse_hosts([{"address": "h", "chip": "v6e", "topology": "3x1"}], default_catalog())


def test_cloud_errors_become_decisions():
    from google.api_core import exceptions as gx
    from backends.base import QuotaError, TransientError
    assert isinstance(cloud_error(gx.ResourceExhausted("no capacity"), "create", "v5p"),
                      QuotaError)
    assert isinstance(cloud_error(gx.ServiceUnavailable("x"), "create", None), TransientError)
    e = cloud_error(gx.PermissionDenied("x"), "create", None)
    assert isinstance(e, ConfigError) and "roles/tpu.admin" in str(e)
    assert isinstance(cloud_error(gx.InvalidArgument("x"), "create", None), ConfigError)


def test_the_shipped_gcp_config_parses_and_launches_the_simulated_budget():
    """deploy/gcp/cluster.yaml is what a user starts from: it parses, and its engines run the
    step token budget the cluster simulator (and so the policy's pricing) assumes."""
    from pathlib import Path

    import yaml

    from backends.config import parse_sections
    from dse.catalog import default_catalog
    from orchestrator.cluster import ClusterConfig
    path = Path(__file__).resolve().parents[2] / "deploy" / "gcp" / "cluster.yaml"
    s = parse_sections("tpu", yaml.safe_load(path.read_text()), default_catalog(), "m",
                       check_files=False)
    assert s.engine.max_num_batched_tokens == ClusterConfig().max_batched_tokens
    assert EngineSettings().max_num_batched_tokens == ClusterConfig().max_batched_tokens
