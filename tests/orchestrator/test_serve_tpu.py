"""`orchestrator serve --backend tpu` end to end, with everything real but Google's servers: the
real `google-cloud-tpu` client talks to the fake TPU API (gRPC on 127.0.0.1,
tests/backends/fake_tpu.py); every slice's workers are loopback addresses (127.0.0.x) served by
one real sshd, whose host key the fake publishes in the VMs' guest attributes; the launcher
starts each vPod's engine over SSH with the same code path as `vllm serve` - the engine being
the simulated vLLM server (`python -m backends.sim.engine_server`, which takes vLLM's flags) -
and requests go through the gateway with the official `openai` client."""
import itertools
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

from fake_tpu import FakeTpuServer, make_client  # noqa: E402
from sshd import SSHD, LocalSSHD, free_port  # noqa: E402
from test_serve_e2e import wait_for  # noqa: E402

PROJECT, ZONE5P, ZONE6E = "proj-1", "us-east5-a", "us-east5-b"
HOSTS = tuple(f"127.0.0.{i}" for i in range(2, 17))     # sshd listens on <= 16 sockets


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    """A fake TPU API whose VMs are loopback addresses, one sshd listening on all of them."""
    if not os.path.exists(SSHD):
        pytest.skip("sshd is missing: apt-get install -y openssh-server")
    sshd = LocalSSHD(extra_hosts=HOSTS)
    ips = itertools.cycle(HOSTS)           # a deleted VM's address is reused later
    base = tmp_path_factory.getbasetemp()

    def vm_gone(node_name: str) -> None:
        """A deleted or preempted "VM" stops what runs on it: the engines the launcher
        started in its directory (``<test>/hosts/<node id>``, each its own process group)."""
        node_id = node_name.rsplit("/", 1)[-1]
        for pid_file in base.glob(f"*/hosts/{node_id}/pid"):
            try:
                pid = int(pid_file.read_text().strip())
                # only the VM's own wrapper: a stale pid may have been reused since
                if str(pid_file.parent) in Path(f"/proc/{pid}/cmdline").read_text():
                    os.killpg(pid, signal.SIGKILL)
            except (ValueError, OSError):
                pass                        # not started, or gone already
    fake = FakeTpuServer(create_delay_s=0.3, delete_delay_s=0.1, on_gone=vm_gone,
                         worker_ips=lambda name, n: [next(ips) for _ in range(n)]).start()
    fake.default_host_keys = dict([sshd.host_public.split()[:2]])
    yield fake, sshd
    for name in fake.node_names():          # the fake cloud goes away with its VMs
        vm_gone(name)
    fake.stop()
    sshd.close()


def write_config(tmp: Path, fake, sshd, cluster: str, **extra) -> Path:
    workdir = tmp / "hosts"                 # the "VMs'" directories (one machine here)
    cfg = {
        "backend": "tpu", "cluster": cluster, "model": "llama3-8b", "predictor": "fixed:40",
        "tpu": {"project": PROJECT,
                "zones": {"v5p": [ZONE5P], "v6e": [ZONE6E], "v5e": ["us-west4-a"],
                          "v4": ["us-central2-b"]},
                "api_endpoint": fake.address, "insecure_channel": True, "poll_s": 0.2,
                "labels": {"team": "test"}},
        "ssh": {"user": sshd.user, "key_path": sshd.key_path, "port": sshd.port,
                "connect_timeout_s": 5},
        "engine": {"model": "llama3-8b",
                   "command": [sys.executable, "-m", "backends.sim.engine_server", "--model"],
                   "check": "true", "install": "false", "listen": "worker",
                   "port": free_port(), "workdir": str(workdir), "ready_timeout_s": 120,
                   "hf_token_env": None},
    }
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    path = tmp / f"{cluster}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Serve:
    def __init__(self, tmp: Path, config: Path, *args: str):
        self.log = tmp / f"serve-{time.time_ns()}.log"
        self.state = tmp / f"{config.stem}.db"
        cmd = [sys.executable, "-m", "orchestrator.cli", "serve", "--config", str(config),
               "--port", "0", "--state", str(self.state), "--log-level", "info", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                     stderr=open(self.log, "w"),
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)))
        m = wait_for(lambda: re.search(r"at (http://127\.0\.0\.1:\d+)/v1", self.text())
                     or self.proc.poll() is not None, 180, 0.1)
        if not isinstance(m, re.Match):
            raise AssertionError(f"serve did not start: {self.text()[-3000:]}")
        self.url = m.group(1)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def status(self) -> dict:
        with urllib.request.urlopen(self.url + "/admin/status", timeout=10) as r:
            return json.loads(r.read())

    def ready(self, n: int = 2):
        def check():
            s = self.status()
            ok = [v for v in s["vpods"] if v["state"] == "ready"]
            phases = {v["phase"] for v in ok}
            return s if len(ok) >= n and phases == {"prefill", "decode"} else None
        s = wait_for(check, 120, 0.5)
        assert s, f"no ready vPods: {self.status()}\n{self.text()[-3000:]}"
        return s

    def stop(self, sig=signal.SIGINT) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def nodes(fake, cluster: str | None = None) -> list:
    out = []
    for name in fake.node_names():
        n = fake.node(name)
        if n is not None and (cluster is None or n.labels.get("neuscale-cluster") == cluster):
            out.append(n)
    return out


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_serve_on_the_tpu_api_restart_reconciles_and_down_deletes_only_ours(
        cloud, tmp_path, llama8b_db):
    fake, sshd = cloud
    cfg = write_config(tmp_path, fake, sshd, "alpha", db=str(llama8b_db[1]))
    # a node that is not ours (no labels): nothing may touch it
    other = make_client(fake.address).create_node(
        parent=f"projects/{PROJECT}/locations/{ZONE6E}", node_id="someone-elses",
        node={"accelerator_config": {"type_": "V6E", "topology": "1x1"},
              "runtime_version": "v2-alpha-tpuv6e"})
    other.result(timeout=30)
    s = Serve(tmp_path, cfg)
    try:
        st = s.ready()
        ours = nodes(fake, "alpha")
        assert len(ours) == len(st["vpods"]) >= 2
        for n in ours:
            # labels, the spec in the metadata, the runtime version of the generation
            assert n.labels["neuscale-vpod"] == n.name.rsplit("/", 1)[-1]
            assert n.labels["team"] == "test" and n.labels["neuscale-phase"] in (
                "prefill", "decode")
            spec = json.loads(n.metadata["neuscale-spec"])
            assert spec["id"] == n.labels["neuscale-vpod"]
            assert n.runtime_version.startswith("v2-alpha-tpuv") or \
                n.runtime_version == "tpu-ubuntu2204-base"
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.completions.create(model="llama3-8b", prompt="Hello TPU " * 20, max_tokens=24)
        assert r.usage.completion_tokens == 24 and r.choices[0].text
        chunks = list(c.chat.completions.create(
            model="llama3-8b", messages=[{"role": "user", "content": "stream please"}],
            max_tokens=16, stream=True))
        text = "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
        assert text and chunks[-1].choices[0].finish_reason in ("length", "stop")
        # the engine's log, through `orchestrator logs`
        vid = st["vpods"][0]["id"]
        lg = cli("logs", vid, "--config", str(cfg), "--lines", "5")
        assert lg.returncode == 0, lg.stderr
        assert "http://" in lg.stdout
        creates = fake.call_count("CreateNode")
        # kill -9 and restart: the new controller adopts every node, creates no duplicate
        s.stop(signal.SIGKILL)
        s = Serve(tmp_path, cfg)
        s.ready()
        assert fake.call_count("CreateNode") == creates
        assert sorted(n.name for n in nodes(fake, "alpha")) == sorted(n.name for n in ours)
        assert "adopt" in {a["kind"] for a in s.status()["recent_actions"]}
        r = c.with_options(base_url=s.url + "/v1").completions.create(
            model="llama3-8b", prompt="after the restart", max_tokens=8)
        assert r.usage.completion_tokens == 8
    finally:
        s.stop()
    # a clean stop keeps the VMs (tpu default) ...
    assert len(nodes(fake, "alpha")) >= 2
    # ... and `orchestrator down` deletes every one of ours and nothing else
    d = cli("down", "--config", str(cfg), "--json")
    assert d.returncode == 0, d.stderr
    assert wait_for(lambda: not nodes(fake, "alpha"), 30)
    assert fake.node(f"projects/{PROJECT}/locations/{ZONE6E}/nodes/someone-elses") is not None
    assert len(json.loads(d.stdout)["deleted"]) >= 2


def test_stockout_fails_over_and_transient_errors_are_retried(cloud, tmp_path, llama8b_db):
    fake, sshd = cloud
    cfg = write_config(tmp_path, fake, sshd, "beta", db=str(llama8b_db[1]))
    fake.stockout = {"v5p"}                      # the best fits' generation has no capacity
    fake.fail_next("CreateNode", __import__("grpc").StatusCode.UNAVAILABLE, n=2)
    s = Serve(tmp_path, cfg)
    try:
        st = s.ready()
        chips = {v["chip"] for v in st["vpods"] if v["state"] == "ready"}
        assert "v5p" not in chips, st["vpods"]
        assert any(v.get("failover") for v in st["vpods"]), st["vpods"]
        ids = [n.labels["neuscale-vpod"] for n in nodes(fake, "beta")]
        assert len(ids) == len(set(ids))
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert c.completions.create(model="llama3-8b", prompt="fail-over",
                                    max_tokens=5).usage.completion_tokens == 5
        assert "quota" in s.text().lower() or "capacity" in s.text().lower()
    finally:
        s.stop()
        fake.stockout = set()
        cli("down", "--config", str(cfg))
    assert wait_for(lambda: not nodes(fake, "beta"), 30)


def test_permission_denied_is_one_clear_error(cloud, tmp_path, llama8b_db):
    fake, sshd = cloud
    import grpc
    cfg = write_config(tmp_path, fake, sshd, "gamma", db=str(llama8b_db[1]))
    fake.fail_next("ListNodes", grpc.StatusCode.PERMISSION_DENIED, n=1)
    r = cli("serve", "--config", str(cfg), "--port", "0", "--state",
            str(tmp_path / "g.db"))
    assert r.returncode == 2, r.stderr[-2000:]
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "roles/tpu.admin" in err[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_dry_run_prints_the_plan_and_calls_no_api(cloud, tmp_path, llama8b_db):
    fake, sshd = cloud
    cfg = write_config(tmp_path, fake, sshd, "delta", db=str(llama8b_db[1]))
    before = len(fake.calls)
    r = cli("serve", "--config", str(cfg), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert len(fake.calls) == before                  # no API call
    assert {v["phase"] for v in d["vpods"]} == {"prefill", "decode"}
    for v in d["vpods"]:
        cmd = v["commands"][-1]["command"]
        assert f"--max-num-seqs {v['max_batch']}" in cmd
        assert f"--tensor-parallel-size {v['tp']}" in cmd
        assert "--served-model-name llama3-8b" in cmd
        assert v["zone"] in (ZONE5P, ZONE6E, "us-west4-a", "us-central2-b")


def test_queued_resources_provision_serve_and_go_down(cloud, tmp_path, llama8b_db):
    fake, sshd = cloud
    cfg = write_config(tmp_path, fake, sshd, "epsilon", db=str(llama8b_db[1]),
                       tpu={"provisioning": "queued", "spot": True})
    s = Serve(tmp_path, cfg)
    try:
        st = s.ready()
        ours = nodes(fake, "epsilon")
        assert len(ours) == len(st["vpods"])
        assert fake.call_count("CreateQueuedResource") == len(ours)
        assert fake.call_count("CreateNode") == 0 or all(n.queued_resource for n in ours)
        for n in ours:
            q = fake.queued_resource(n.queued_resource)
            from google.cloud import tpu_v2
            assert q is not None and tpu_v2.QueuedResource.pb(q).HasField("spot")
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert c.completions.create(model="llama3-8b", prompt="queued",
                                    max_tokens=4).usage.completion_tokens == 4
        qr_names = [n.queued_resource for n in ours]
    finally:
        s.stop()
    d = cli("down", "--config", str(cfg))
    assert d.returncode == 0, d.stderr
    assert wait_for(lambda: not nodes(fake, "epsilon"), 30)
    assert wait_for(lambda: all(fake.queued_resource(q) is None for q in qr_names), 30)


def test_static_hosts_serve_survive_a_restart_and_go_down(cloud, tmp_path, llama8b_db):
    _, sshd = cloud
    hosts = HOSTS[-2:]
    known = tmp_path / "known_hosts"
    known.write_text("".join(f"[{h}]:{sshd.port} {sshd.host_public}\n" for h in hosts))
    workdir = tmp_path / "hosts"
    cfg = tmp_path / "static.yaml"
    cfg.write_text(yaml.safe_dump({
        "backend": "static", "cluster": "zeta", "model": "llama3-8b",
        "db": str(llama8b_db[1]), "predictor": "fixed:40",
        "hosts": [{"name": f"vm{i}", "address": h, "chip": "v5p", "topology": "2x2x1"}
                  for i, h in enumerate(hosts)],
        "ssh": {"user": sshd.user, "key_path": sshd.key_path, "known_hosts": str(known),
                "port": sshd.port},
        "engine": {"model": "llama3-8b",
                   "command": [sys.executable, "-m", "backends.sim.engine_server", "--model"],
                   "check": "true", "install": "false", "listen": "worker",
                   "port": free_port(), "workdir": str(workdir), "ready_timeout_s": 120,
                   "hf_token_env": None}}))

    def engines() -> list[str]:
        return sorted(p.name for p in workdir.iterdir() if (p / "record.json").exists()
                      and (p / "pid").exists()) if workdir.exists() else []
    s = Serve(tmp_path, cfg)
    try:
        st = s.ready()
        assert len(engines()) == len(st["vpods"]) == 2
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert c.completions.create(model="llama3-8b", prompt="static",
                                    max_tokens=6).usage.completion_tokens == 6
        before = engines()
        s.stop(signal.SIGKILL)
        s = Serve(tmp_path, cfg)
        s.ready()
        assert engines() == before                   # adopted, nothing started twice
        assert "adopt" in {a["kind"] for a in s.status()["recent_actions"]}
    finally:
        s.stop()
    d = cli("down", "--config", str(cfg))
    assert d.returncode == 0, d.stderr
    assert engines() == []
