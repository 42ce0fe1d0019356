"""The sim cloud as a real process (``python -m backends.sim.cloud``) and its client
:class:`SimBackend`: the vPod life cycle, idempotency, labels, quotas, typed errors, retries,
the kill hook, and a cloud that outlives its client and stops cleanly."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from backends.base import (BackendError, ConfigError, QuotaError, TransientError, VPodSpec,
                           with_retries)
from backends.sim import CloudProcess, SimBackend
from dse.vpod import VPodState

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--time-scale", "1000"]           # Table 3's ~2 min start-up in ~0.13 s


def spec(vid: str, cluster: str = "t", chip: str = "v6e", topology: str = "1x1",
         phase: str = "decode", **kw) -> VPodSpec:
    d = dict(id=vid, group="g1", phase=phase, model="llama3-8b", chip=chip, topology=topology,
             num_chips=1, tp=1, pp=1, ep=1, max_batch=16, max_model_len=4096,
             labels={"neuscale-cluster": cluster, "neuscale-vpod": vid,
                     "neuscale-phase": phase})
    d.update(kw)
    return VPodSpec(**d)


@pytest.fixture(scope="module")
def cloud():
    c = CloudProcess.start([*FAST, "--quota", "v6e=2,v5p=2"])
    yield c
    assert c.stop() == 0


async def http_get(url: str) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            await r.read()
            return r.status


async def refused(url: str) -> bool:
    try:
        await http_get(url)
    except aiohttp.ClientConnectionError:
        return True
    return False


async def released(b: SimBackend, vid: str, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while (await b.get(vid)).state != VPodState.RELEASED:
        assert time.monotonic() < end, f"{vid} not released"
        await asyncio.sleep(0.01)


def test_create_is_idempotent_lists_by_label_and_delete_releases_chips(cloud):
    async def go():
        b = SimBackend(cloud.url)
        s = spec("life-d1", cluster="life")
        i1 = await b.create(s)
        assert i1.state == VPodState.STARTING and i1.endpoint is None and i1.spec == s
        i2 = await b.create(s)                          # the same id and spec: the same vPod
        assert i2.created_s == i1.created_s
        with pytest.raises(ConfigError, match="differs in max_batch"):
            await b.create(spec("life-d1", cluster="life", max_batch=8))
        info = await b.wait_ready("life-d1", timeout_s=30)
        assert info.state == VPodState.READY and info.ready_s >= info.created_s
        assert await http_get(info.endpoint + "/health") == 200
        async with aiohttp.ClientSession() as sess:
            async with sess.get(info.endpoint + "/v1/models") as r:
                assert (await r.json())["data"][0]["max_model_len"] == 4096
            async with sess.post(info.endpoint + "/v1/completions", json={
                    "model": "llama3-8b", "prompt": "hello", "max_tokens": 3}) as r:
                assert (await r.json())["usage"]["completion_tokens"] == 3
        await b.create(spec("life-p1", cluster="other", chip="v4", topology="1x1x1",
                            phase="prefill"))
        assert [i.spec.id for i in await b.list({"neuscale-cluster": "life"})] == ["life-d1"]
        assert [i.spec.id for i in await b.list({"neuscale-phase": "prefill",
                                                 "neuscale-cluster": "other"})] == ["life-p1"]
        assert {"life-d1", "life-p1"} <= {i.spec.id for i in await b.list()}
        assert (await b.quotas())["v6e"] == {"limit": 2, "used": 1}
        await b.delete("life-d1")
        assert (await b.get("life-d1")).state == VPodState.DRAINING
        assert await refused(info.endpoint + "/health")            # the engine stopped
        with pytest.raises(BackendError, match="draining|released"):
            await b.wait_ready("life-d1", timeout_s=5)
        await released(b, "life-d1")
        assert [i.spec.id for i in await b.list({"neuscale-cluster": "life"})] == []
        assert (await b.quotas())["v6e"]["used"] == 0
        await b.delete("life-d1")                       # idempotent
        await b.delete("never-there")
        assert await b.get("never-there") is None
        with pytest.raises(BackendError, match="does not exist"):
            await b.wait_ready("never-there", timeout_s=1)
        await b.delete("life-p1")
        await b.close()

    asyncio.run(go())


def test_quota_is_per_chip_version_and_released_chips_return(cloud):
    async def go():
        b = SimBackend(cloud.url)
        assert (await b.quotas())["v5p"] == {"limit": 2, "used": 0}   # only this test's chip
        for i in (1, 2):
            await b.create(spec(f"q-{i}", cluster="quota", chip="v5p", topology="1x1x1"))
        with pytest.raises(QuotaError) as e:
            await b.create(spec("q-3", cluster="quota", chip="v5p", topology="1x1x1"))
        assert e.value.chip == "v5p" and "2 of 2" in str(e.value)
        # not retried: a quota error is the caller's cue to fail over
        calls = 0

        async def create():
            nonlocal calls
            calls += 1
            return await b.create(spec("q-3", cluster="quota", chip="v5p", topology="1x1x1"))

        with pytest.raises(QuotaError):
            await with_retries(create, base_s=0.001)
        assert calls == 1
        # fail-over to another version works at once
        other = await b.create(spec("q-3", cluster="quota", chip="v5e", topology="2x1",
                                    num_chips=2, tp=2))
        assert other.spec.chip == "v5e"
        # a deleted vPod's chips count until it is released, then return to the quota
        await b.delete("q-1")
        await released(b, "q-1")
        await b.create(spec("q-4", cluster="quota", chip="v5p", topology="1x1x1"))
        for vid in ("q-2", "q-3", "q-4"):
            await b.delete(vid)
        await b.close()

    asyncio.run(go())


@pytest.mark.parametrize("kw, words", [
    (dict(chip="v9z"), "unknown chip"),
    (dict(tp=2), r"tp\*pp\*ep = 2 must equal num_chips = 1"),
    (dict(topology="2x2"), "topology"),
    (dict(model="llama3-70b"), "does not fit"),
    (dict(model="no-such-model"), "unknown model"),
    (dict(max_model_len=100_000), "context"),
    (dict(id="bad id!"), "id"),
])
def test_bad_specs_are_config_errors_with_one_clear_message(cloud, kw, words):
    async def go():
        b = SimBackend(cloud.url)
        with pytest.raises(ConfigError, match=words) as e:
            await with_retries(lambda: b.create(spec("cfg-1", cluster="cfg", **kw)))
        assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
        assert await b.get("cfg-1") is None
        await b.close()

    asyncio.run(go())


def test_kill_hook_crashes_the_engine_but_the_vpod_stays(cloud):
    async def go():
        b = SimBackend(cloud.url)
        await b.create(spec("kill-1", cluster="kill"))
        info = await b.wait_ready("kill-1", timeout_s=30)
        async with aiohttp.ClientSession() as s:
            async with s.post(info.endpoint + "/v1/completions", json={
                    "model": "llama3-8b", "prompt": "a long story", "max_tokens": 500,
                    "ignore_eos": True, "stream": True}) as r:
                await r.content.readline()
                after = await b.kill("kill-1")
                with pytest.raises(aiohttp.ClientError):
                    async for _ in r.content:
                        pass
        assert after.state == VPodState.READY and "crashed" in after.message
        assert await refused(info.endpoint + "/health")
        listed = await b.list({"neuscale-cluster": "kill"})
        assert [i.state for i in listed] == [VPodState.READY]      # the VM is still there
        await b.delete("kill-1")
        await b.close()

    asyncio.run(go())


def test_transient_errors_are_retried_and_wait_ready_times_out():
    c = CloudProcess.start(["--time-scale", "1", "--fail-create-every", "2"])
    try:
        async def go():
            b = SimBackend(c.url)
            await b.create(spec("tr-1", cluster="tr"))                 # call 1: fine
            with pytest.raises(TransientError, match="busy"):
                await b.create(spec("tr-2", cluster="tr"))             # call 2: 503
            info = await with_retries(lambda: b.create(spec("tr-2", cluster="tr")),
                                      base_s=0.01)                     # 3: fine
            assert info.state == VPodState.STARTING
            # unscaled Table 3: minutes to start, so a short wait times out (transient)
            t = time.monotonic()
            with pytest.raises(TransientError, match="not ready"):
                await b.wait_ready("tr-1", timeout_s=0.3)
            assert time.monotonic() - t < 2
            # deleted while starting: waiting for it fails for good
            waiter = asyncio.ensure_future(b.wait_ready("tr-2", timeout_s=30))
            await asyncio.sleep(0.1)
            await b.delete("tr-2")
            with pytest.raises(BackendError, match="draining"):
                await waiter
            await b.close()
            # no cloud at all: transient, and with_retries gives up after its attempts
            dead = SimBackend("http://127.0.0.1:9", timeout_s=1)
            with pytest.raises(TransientError, match="cannot reach"):
                await with_retries(lambda: dead.list(), attempts=2, base_s=0.01)
            await dead.close()

        asyncio.run(go())
    finally:
        assert c.stop() == 0          # SIGTERM with vPods still starting: a clean exit


CLIENT = textwrap.dedent("""
    import asyncio, os, sys
    from backends.base import VPodSpec
    from backends.sim import SimBackend
    async def main():
        b = SimBackend(sys.argv[1])
        await b.create(VPodSpec(id="surv-1", group="g", phase="decode", model="llama3-8b",
                                chip="v6e", topology="1x1", num_chips=1, tp=1, pp=1, ep=1,
                                max_batch=8, max_model_len=2048,
                                labels={"neuscale-cluster": "surv"}))
        await b.wait_ready("surv-1", 30)
        os.kill(os.getpid(), 9)          # the controller dies without a word
    asyncio.run(main())
""")


def test_the_cloud_outlives_its_client_stops_cleanly_and_restores_its_vpods(tmp_path):
    db = tmp_path / "cloud.json"
    c = CloudProcess.start([*FAST, "--db", str(db)])
    try:
        assert os.getsid(c.pid) == c.pid != os.getsid(0)    # a session of its own
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        p = subprocess.run([sys.executable, "-c", CLIENT, c.url], env=env, timeout=60)
        assert p.returncode == -signal.SIGKILL

        async def after_client_died():
            b = SimBackend(c.url)
            (info,) = await b.list({"neuscale-cluster": "surv"})
            assert info.spec.id == "surv-1" and info.state == VPodState.READY
            assert await http_get(info.endpoint + "/health") == 200
            await b.close()
            return info

        info = asyncio.run(after_client_died())
    finally:
        code = c.stop()
    assert code == 0                                    # SIGTERM: a clean exit
    assert asyncio.run(refused(info.endpoint + "/health"))     # engine ports closed
    assert asyncio.run(refused(c.url + "/health"))

    c2 = CloudProcess.start([*FAST, "--db", str(db)])   # a restarted cloud brings it back
    try:
        async def restored():
            b = SimBackend(c2.url)
            (again,) = await b.list({"neuscale-cluster": "surv"})
            assert again.spec == info.spec and again.created_s == info.created_s
            ready = await b.wait_ready("surv-1", 30)
            async with aiohttp.ClientSession() as s:
                async with s.post(ready.endpoint + "/v1/completions", json={
                        "model": "llama3-8b", "prompt": "still here?", "max_tokens": 2}) as r:
                    assert (await r.json())["usage"]["completion_tokens"] == 2
            await b.close()

        asyncio.run(restored())
    finally:
        assert c2.stop() == 0
