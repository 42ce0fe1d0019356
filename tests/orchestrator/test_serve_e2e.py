"""`orchestrator serve --backend sim` end to end: the real process, the real sim cloud, real
engine servers on 127.0.0.1, the official `openai` client. One serve process is shared by the
heavy tests (module scope); the restart and API-key tests start their own."""
import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

from dse.tokens import count_tokens

ROOT = Path(__file__).resolve().parents[2]
SCALE = "120"          # control plane x120: a 5-min epoch is 2.5 s, the 30-min window 15 s


class Serve:
    """``orchestrator serve`` as a subprocess; ``url`` once it announced itself."""

    def __init__(self, tmp: Path, *args: str, env: dict | None = None, state: Path | None = None):
        self.state = state or tmp / "state.db"
        self.log = tmp / f"serve-{time.time_ns()}.log"
        cmd = [sys.executable, "-m", "orchestrator.cli", "serve", "--backend", "sim",
               "--port", "0", "--state", str(self.state), "--time-scale", SCALE, *args]
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"),
                                     env=self.env)
        deadline = time.time() + 180
        while time.time() < deadline:
            m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", self.log.read_text())
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        raise AssertionError("serve did not start")

    def get(self, path: str, headers: dict | None = None):
        req = urllib.request.Request(self.url + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()

    def status(self) -> dict:
        return json.loads(self.get("/admin/status")[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def cloud_vpods(state: Path, cluster: str = "neuscale") -> list[dict]:
    url = sqlite3.connect(state).execute(
        "SELECT value FROM meta WHERE key = 'sim_cloud_url'").fetchone()[0]
    with urllib.request.urlopen(f"{url}/v1/vpods?label=neuscale-cluster={cluster}",
                                timeout=10) as r:
        return json.loads(r.read())["vpods"]


def kill_cloud(state: Path) -> None:
    row = sqlite3.connect(state).execute(
        "SELECT value FROM meta WHERE key = 'sim_cloud_pid'").fetchone()
    if row and row[0]:
        try:
            os.kill(int(row[0]), signal.SIGTERM)
        except OSError:
            pass


def wait_for(cond, timeout_s: float, every_s: float = 0.3):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(every_s)
    return cond()


@pytest.fixture(scope="module")
def serve(tmp_path_factory, llama8b_db):
    tmp = tmp_path_factory.mktemp("serve")
    # the serving mechanics (groups by length, migration, fail-over) on the paper's rule, one
    # group per best fit; the default load-aware policy serves the restart and quota tests
    s = Serve(tmp, "--db", str(llama8b_db[1]), "--predictor", "fixed:40",
              "--policy", "neuscale-paper", "--policy-option", "coalescing=false")
    yield s
    s.stop()
    kill_cloud(s.state)


def client(s: Serve, **kw) -> OpenAI:
    return OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)


def test_chat_and_completions_streaming_and_not_with_exact_usage(serve):
    c = client(serve)
    prompt = "Tell me about the tides of the northern sea, briefly."
    r = c.completions.create(model="llama3-8b", prompt=prompt, max_tokens=12,
                             extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == count_tokens(prompt) and r.usage.completion_tokens == 12
    assert r.choices[0].finish_reason == "length" and count_tokens(r.choices[0].text) == 12
    chat = c.chat.completions.create(model="llama3-8b", max_tokens=9,
                                     messages=[{"role": "user", "content": prompt}])
    assert chat.usage.completion_tokens <= 9 and chat.choices[0].message.role == "assistant"
    pieces, usage = [], None
    for ch in c.chat.completions.create(model="llama3-8b", max_tokens=20, stream=True,
                                        stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True},
                                        messages=[{"role": "user", "content": prompt}]):
        if ch.choices and ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
        if ch.usage:
            usage = ch.usage
    assert usage.completion_tokens == 20 and count_tokens("".join(pieces)) == 20
    # the same request, not streamed, gives the same text (deterministic synthetic text)
    whole = c.chat.completions.create(model="llama3-8b", max_tokens=20,
                                      extra_body={"ignore_eos": True},
                                      messages=[{"role": "user", "content": prompt}])
    assert whole.choices[0].message.content == "".join(pieces)
    assert [m.id for m in c.models.list().data] == ["llama3-8b"]


def test_bad_input_gets_its_4xx(serve):
    import urllib.error

    def post(body: bytes, path="/v1/completions"):
        req = urllib.request.Request(serve.url + path, data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    cases = [(b"{not json", 400), (b'{"prompt": "x"}', 400),
             (b'{"model": "gpt-9", "prompt": "x"}', 404),
             (b'{"model": "llama3-8b", "prompt": "x", "max_tokens": -1}', 400),
             (b'{"model": "llama3-8b", "prompt": "x", "n": 2}', 400),
             (json.dumps({"model": "llama3-8b", "prompt": "word " * 9000}).encode(), 400),
             (b'{"model": "llama3-8b", "messages": "hi"}', 400)]
    for body, code in cases:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        status, err = post(body, path)
        assert status == code and err["error"]["message"], (body[:40], status, err)
    status, err = post(json.dumps({"model": "llama3-8b", "prompt": "word " * 9000}).encode())
    assert err["error"]["code"] == "context_length_exceeded"


def test_a_load_step_scales_a_group_out_and_then_in(serve):
    async def load(seconds: float):
        c = AsyncOpenAI(base_url=serve.url + "/v1", api_key="x", max_retries=2, timeout=120)
        end = time.time() + seconds

        async def worker():
            while time.time() < end:
                await c.completions.create(model="llama3-8b", prompt="tok " * 3000,
                                           max_tokens=40, extra_body={"ignore_eos": True})
        await asyncio.gather(*(worker() for _ in range(48)))

    def busiest():
        groups = serve.status()["groups"]
        return max((g["vpods"] for g in groups), default=0)

    before = busiest()
    asyncio.run(load(10.0))
    peak = busiest()
    assert peak >= 2 and peak > before, serve.status()["groups"]
    # idle: the window (15 s at x120) forgets the burst and the groups shrink
    assert wait_for(lambda: busiest() < peak, 60, every_s=1.0), serve.status()["groups"]
    acts = [a["kind"] for a in serve.status()["recent_actions"]]
    assert "create" in " ".join(acts) or "delete" in acts


def test_300_concurrent_mixed_requests_all_complete(serve):
    async def run():
        c = AsyncOpenAI(base_url=serve.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(i):
            n = [8, 60, 400, 1500][i % 4]
            out = [5, 30, 80][i % 3]
            r = await c.completions.create(model="llama3-8b", prompt="tok " * n,
                                           max_tokens=out, stream=False,
                                           extra_body={"ignore_eos": True})
            return (r.usage.completion_tokens == out
                    and r.usage.prompt_tokens == count_tokens("tok " * n))
        return await asyncio.gather(*(one(i) for i in range(300)))
    assert all(asyncio.run(run()))


def test_short_and_long_requests_land_in_different_groups(serve):
    c = client(serve)
    long_prompt, short_prompt = "tok " * 6000, "tok " * 40

    def mixed():
        for _ in range(6):
            c.completions.create(model="llama3-8b", prompt=short_prompt, max_tokens=20,
                                 extra_body={"ignore_eos": True})
            c.completions.create(model="llama3-8b", prompt=long_prompt, max_tokens=20,
                                 extra_body={"ignore_eos": True})

    def split():
        mixed()
        r = serve.status()["routing"]
        p = r.get("prefill") or {}
        d = r.get("decode") or {}
        edges = [int(e) for e in d]
        small = next(str(e) for e in edges if e >= 60)
        large = next(str(e) for e in edges if e >= 6020)
        return d and d[small] != d[large] and p

    assert wait_for(split, 60, every_s=0.5), serve.status()["routing"]


def test_a_stream_that_outgrows_its_group_migrates_in_one_piece(serve):
    """fixed:40 predicts every output 40 tokens long: a long answer to a short prompt starts in
    the short decode group and must move on past twice its best-fit length."""
    c = client(serve)
    short = dict(model="llama3-8b", prompt="tok " * 30, max_tokens=20,
                 extra_body={"ignore_eos": True})

    def short_group():
        for _ in range(3):           # keep the short bucket in the window
            c.completions.create(**short)
        st = serve.status()
        g = (st["routing"].get("decode") or {}).get("128")
        ready = any(v["group"] == g and v["state"] == "ready" for v in st["vpods"])
        best = st["best_len"]["decode"].get(g, 10 ** 9) if g else 10 ** 9
        return (g, best) if ready and 2 * best + 200 < 8000 else None
    got = wait_for(short_group, 60, every_s=0.5)
    assert got, serve.status()["routing"]
    n_out = 2 * got[1] + 150
    # a prompt whose (synthetic, deterministic) answer runs at least n_out tokens on its own:
    # the gateway learns it only as the stream grows (no ignore_eos, no min_tokens)
    from backends.sim.text import intrinsic_length, request_key
    prompt = next(p for i in range(10_000) if intrinsic_length(
        request_key(p := "tok " * 30 + f"q{i}", None)) >= n_out)
    long_answer = dict(model="llama3-8b", prompt=prompt, max_tokens=n_out)
    before = migrations(serve)
    text, usage, ids = [], None, set()
    for ch in c.completions.create(**long_answer, stream=True,
                                   stream_options={"include_usage": True}):
        ids.add(ch.id)
        if ch.choices:
            text.append(ch.choices[0].text)
        if ch.usage:
            usage = ch.usage
    assert usage.completion_tokens == n_out and count_tokens("".join(text)) == n_out
    assert len(ids) == 1
    assert migrations(serve) > before
    # the same text as one engine gives (continuations are exact)
    whole = c.completions.create(**long_answer)
    assert whole.choices[0].text == "".join(text)


def migrations(serve) -> float:
    text = serve.get("/metrics")[1]
    m = re.search(r"^neuscale_migrations_total ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def stream_and_kill(s: Serve, max_tokens: int, doomed) -> tuple[str, object, list[str]]:
    """Stream ``max_tokens`` tokens; after 20, kill (in the sim cloud) the decode vPods that
    ``doomed(vpod)`` picks from the status. Returns the text, the usage and the killed ids."""
    stream = client(s).completions.create(
        model="llama3-8b", prompt="tok " * 100, max_tokens=max_tokens, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    text, usage, killed = [], None, None
    for ch in stream:
        if ch.choices:
            text.append(ch.choices[0].text)
        if ch.usage:
            usage = ch.usage
        if killed is None and len(text) > 20:
            killed = [v["id"] for v in s.status()["vpods"]
                      if v["phase"] == "decode" and v["state"] == "ready" and doomed(v)]
            cloud = sqlite3.connect(s.state).execute(
                "SELECT value FROM meta WHERE key='sim_cloud_url'").fetchone()[0]
            for vid in killed:
                urllib.request.urlopen(urllib.request.Request(
                    f"{cloud}/v1/vpods/{vid}/kill", method="POST"), timeout=10).read()
    return "".join(text), usage, killed or []


def test_killing_an_engine_mid_stream_loses_no_request(serve):
    # kill every decode vPod with a request in flight: whichever serves us dies
    text, usage, killed = stream_and_kill(serve, 400, lambda v: v["in_flight"])
    assert killed, "no decode vPod was serving the stream"
    assert usage.completion_tokens == 400 and count_tokens(text) == 400
    # the controller sees the dead vPods and replaces them
    assert wait_for(lambda: not any(v["id"] in killed for v in serve.status()["vpods"]), 60)


def test_the_only_vpods_dying_mid_stream_lose_no_request(tmp_path, llama8b_db):
    """The default (load-aware) policy serves this light load with one decode vPod: kill it
    mid-stream. The gateway reports the failure, the controller checks the vPod at once and
    starts a replacement, and the stream waits for it and finishes whole."""
    s = Serve(tmp_path, "--db", str(llama8b_db[1]), "--predictor", "fixed:40",
              "--cluster", "e2e-only")
    try:
        client(s).completions.create(model="llama3-8b", prompt="tok " * 50, max_tokens=5)
        text, usage, killed = stream_and_kill(s, 300, lambda v: True)
        assert killed
        assert usage.completion_tokens == 300 and count_tokens(text) == 300
        st = s.status()
        assert not any(v["id"] in killed for v in st["vpods"])
        assert any(e["kind"] == "replace" and "failed under a request" in e["reason"]
                   for e in st["recent_actions"]), st["recent_actions"]
    finally:
        s.stop()
        kill_cloud(s.state)


def test_kill_9_and_restart_leave_no_orphan_or_duplicate(tmp_path, llama8b_db):
    key = "s3cret-" + os.urandom(4).hex()
    env = {"NS_TEST_KEY": key}
    s = Serve(tmp_path, "--db", str(llama8b_db[1]), "--api-key-env", "NS_TEST_KEY",
              "--cluster", "e2e-restart", env=env)
    try:
        auth = {"Authorization": f"Bearer {key}"}
        c = OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)
        # without the key: 401 in OpenAI's format; with it: served
        bad = OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(Exception) as e:
            bad.completions.create(model="llama3-8b", prompt="hi", max_tokens=2)
        assert getattr(e.value, "status_code", None) == 401
        for n in (20, 3000, 20, 3000):
            c.completions.create(model="llama3-8b", prompt="tok " * n, max_tokens=10)
        ours = lambda: {v["id"] for v in json.loads(  # noqa: E731
            s.get("/admin/status", auth)[1])["vpods"]}
        assert wait_for(lambda: len(ours()) >= 2, 30)
        before = ours()
        s.proc.send_signal(signal.SIGKILL)              # the controller dies, the cloud lives
        s.proc.wait(10)
        in_cloud = {v["spec"]["id"] for v in cloud_vpods(s.state, "e2e-restart")
                    if v["state"] != "released"}
        assert before <= in_cloud
        s2 = Serve(tmp_path, "--db", str(llama8b_db[1]), "--api-key-env", "NS_TEST_KEY",
                   "--cluster", "e2e-restart", env=env, state=s.state)
        try:
            status = lambda: {v["id"] for v in json.loads(  # noqa: E731
                s2.get("/admin/status", auth)[1])["vpods"]}
            first = status()
            # every vPod the cloud held is either adopted or was deliberately released by
            # the new controller (a drain it inherited, a scale-in), never recreated
            rows = dict(sqlite3.connect(s.state).execute(
                "SELECT id, state || ':' || COALESCE(reason, '') FROM vpods").fetchall())
            for vid in in_cloud - first:
                assert rows[vid].startswith("released:") \
                    and "not found" not in rows[vid], (vid, rows[vid])
            # and the cloud and the controller agree: no orphan, no duplicate
            cloud = lambda: {v["spec"]["id"] for v in cloud_vpods(  # noqa: E731
                s.state, "e2e-restart") if v["state"] not in ("released", "draining")}
            assert wait_for(lambda: cloud() == status(), 30), (cloud(), status())
            # adopted: the new controller says so in its actions (an adopted vPod may be
            # scaled in by its first epoch before this test looks, on a loaded machine)
            adopted = {a["what"] for a in json.loads(s2.get("/admin/status", auth)[1])[
                "recent_actions"] if a["kind"] == "adopt"}
            assert in_cloud & adopted, "nothing was adopted"
            assert adopted <= in_cloud, adopted - in_cloud
            c2 = OpenAI(base_url=s2.url + "/v1", api_key=key, max_retries=0, timeout=60)
            r = c2.completions.create(model="llama3-8b", prompt="tok " * 20, max_tokens=5)
            assert r.usage.completion_tokens >= 1
        finally:
            s2.stop()
        # the key never reached the logs or the state
        assert key not in s.log.read_text() and key not in s2.log.read_text()
        assert key.encode() not in Path(s.state).read_bytes()
        # a clean stop released everything in the cloud
        state = sqlite3.connect(s.state)
        assert not state.execute("SELECT id FROM vpods WHERE state != 'released'").fetchall()
    finally:
        s.stop()
        kill_cloud(s.state)


def test_a_quota_makes_the_controller_fail_over_to_other_chips(tmp_path, llama8b_db):
    """The sim cloud holds 1 v6e chip: v6e best fits beyond it fail over to other chip
    versions (the cloud answers RESOURCE_EXHAUSTED, the controller re-plans with the quota
    it learned), and every request is still served."""
    s = Serve(tmp_path, "--db", str(llama8b_db[1]), "--quota", "v6e=1", "--cluster", "e2e-q")
    try:
        async def load():
            c = AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=2, timeout=120)

            async def one(i):
                r = await c.completions.create(model="llama3-8b", prompt="tok " * 2000,
                                               max_tokens=20, extra_body={"ignore_eos": True})
                return r.usage.completion_tokens == 20
            return await asyncio.gather(*(one(i) for i in range(200)))
        assert all(asyncio.run(load()))
        vp = s.status()["vpods"]
        assert sum(v["num_chips"] for v in vp if v["chip"] == "v6e") <= 1
        assert any(v["failover"] and v["chip"] != "v6e" for v in vp), vp
    finally:
        s.stop()
        kill_cloud(s.state)
