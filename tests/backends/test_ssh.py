"""The SSH layer (:mod:`backends.ssh`) and the engine launcher (:mod:`backends.launcher`)
against a real OpenSSH server on 127.0.0.1 (tests/backends/sshd.py): strict host-key checking,
key-only login, quoting, SFTP uploads, connection reuse and reconnection, retries, and an engine
process started detached, probed, stopped and listed, with its secret environment kept off
every command line and log."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import paramiko
import pytest

from backends.base import BackendError, ConfigError, TransientError
from backends.launcher import EngineLauncher, wait_http_ready
from backends.ssh import SSHPool, SSHSettings, parse_host_key
from sshd import free_port, keygen, sshd  # noqa: F401  (sshd: the module fixture)


def settings(server, **kw) -> SSHSettings:
    d = dict(user=server.user, key_path=server.key_path, known_hosts=server.known_hosts_path,
             port=server.port, connect_timeout_s=5.0, command_timeout_s=20.0, attempts=3)
    d.update(kw)
    return SSHSettings(**d)


def pool_for(server, trusted=None, **kw) -> SSHPool:
    return SSHPool(settings(server, **kw), trusted, backoff_s=0.02)


def run(coro):
    return asyncio.run(coro)


# ---- connections, host keys, authentication --------------------------------------------------

def test_runs_a_command_with_strict_host_key_checking(sshd):
    async def go():
        pool = pool_for(sshd)
        try:
            res = await pool.run(sshd.host, ["echo", "hello"])
            assert (res.rc, res.stdout, res.stderr) == (0, "hello\n", "")
            res = await pool.run(sshd.host, ["sh", "-c", "echo oops >&2; exit 3"], check=False)
            assert (res.rc, res.stderr) == (3, "oops\n")
            with pytest.raises(BackendError, match=r"(?s)status 3.*oops") as e:
                await pool.run(sshd.host, ["sh", "-c", "echo oops >&2; exit 3"])
            assert not isinstance(e.value, (TransientError, ConfigError))
            res = await pool.run(sshd.host, ["cat"], stdin_data=b"from stdin")
            assert res.stdout == "from stdin"
            res = await pool.run_shell(sshd.host, "a=1; b=2; echo $((a + b)) | tr 3 x")
            assert res.stdout == "x\n"
        finally:
            await pool.close()
    run(go())


def test_refuses_a_mismatched_host_key_and_runs_nothing(sshd, tmp_path):
    other = keygen(tmp_path / "other_host_key", "impostor").split()
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[{sshd.host}]:{sshd.port} {other[0]} {other[1]}\n")
    marker = tmp_path / "ran"
    before = sshd.accepted()

    async def go():
        pool = pool_for(sshd, known_hosts=str(kh))
        with pytest.raises(ConfigError) as e:
            await pool.run(sshd.host, ["touch", str(marker)])
        await pool.close()
        return str(e.value)
    msg = run(go())
    offered = parse_host_key(sshd.host_public)
    assert "MISMATCH" in msg and f"[{sshd.host}]:{sshd.port}" in msg
    assert offered.fingerprint in msg and str(kh) in msg
    assert not marker.exists() and sshd.accepted() == before


def test_refuses_an_unknown_host(sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    marker = tmp_path / "ran"

    async def go():
        pool = pool_for(sshd, known_hosts=str(kh))
        with pytest.raises(ConfigError) as e:
            await pool.run(sshd.host, ["touch", str(marker)])
        await pool.close()
        return str(e.value)
    msg = run(go())
    fp = parse_host_key(sshd.host_public).fingerprint
    assert "unknown host key" in msg and fp in msg and str(kh) in msg
    # how to fix it: the exact line to add, once checked
    assert sshd.host_key_line in msg
    assert not marker.exists()

    async def no_keys_at_all():               # no known_hosts, nothing trusted
        pool = pool_for(sshd, known_hosts=None)
        with pytest.raises(ConfigError, match="ssh.known_hosts"):
            await pool.run(sshd.host, ["true"])
    run(no_keys_at_all())


@pytest.mark.parametrize("form", ["host", "[host]:port", "trust()"])
def test_accepts_a_trusted_key_instead_of_known_hosts(sshd, form):
    name = f"[{sshd.host}]:{sshd.port}" if form == "[host]:port" else sshd.host
    trusted = {name: [sshd.host_public + " from-guest-attributes"]}

    async def go():
        pool = pool_for(sshd, trusted=None if form == "trust()" else trusted,
                        known_hosts=None)
        if form == "trust()":
            with pytest.raises(ConfigError):
                await pool.run(sshd.host, ["true"])
            pool.trust(trusted)                  # e.g. once the VM's guest attributes are read
        try:
            return (await pool.run(sshd.host, ["echo", "ok"])).stdout
        finally:
            await pool.close()
    assert run(go()) == "ok\n"


def test_trusted_key_must_parse():
    with pytest.raises(ConfigError, match="not a valid"):
        SSHPool(SSHSettings(user="u", key_path="/k", known_hosts=None),
                {"h": ["ssh-ed25519 bm90IGEga2V5"]})


def test_key_problems_are_config_errors(sshd, tmp_path):
    stranger = tmp_path / "stranger"
    keygen(stranger, "not-authorized")

    async def go():
        pool = pool_for(sshd, key_path=str(tmp_path / "missing"))
        with pytest.raises(ConfigError, match="ssh.key_path"):
            await pool.run(sshd.host, ["true"])
        bad = tmp_path / "garbage"
        bad.write_text("not a key\n")
        pool = pool_for(sshd, key_path=str(bad))
        with pytest.raises(ConfigError, match="ssh.key_path"):
            await pool.run(sshd.host, ["true"])
        pool = pool_for(sshd, key_path=str(stranger))
        with pytest.raises(ConfigError) as e:
            await pool.run(sshd.host, ["true"])
        assert sshd.user in str(e.value) and sshd.host in str(e.value)
        pool = pool_for(sshd, user="nobody-here")
        with pytest.raises(ConfigError, match="nobody-here"):
            await pool.run(sshd.host, ["true"])
    run(go())


def test_arguments_arrive_intact(sshd):
    args = ["two words", "it's", 'say "hi"', "$HOME", "`id`", "$(id)", "a;b", "&& rm -rf x",
            "*", "~", "back\\slash", "new\nline", "tab\there", "", "-n", "ünï ©ødé", "|", ">x"]

    async def go():
        pool = pool_for(sshd)
        try:
            res = await pool.run(sshd.host, [sys.executable, "-c",
                                             "import sys, json; print(json.dumps(sys.argv[1:]))",
                                             *args])
            return json.loads(res.stdout)
        finally:
            await pool.close()
    assert run(go()) == args


def test_put_file(sshd, tmp_path):
    target = tmp_path / "a b" / "c" / "secret.env"
    data = b"TOKEN=hunter2\n\x00\xff binary too"

    async def go():
        pool = pool_for(sshd)
        try:
            await pool.put_file(sshd.host, str(target), data)
            await pool.put_file(sshd.host, str(tmp_path / "script.sh"), b"#!/bin/sh\n",
                                mode=0o700)
            await pool.put_file(sshd.host, str(target), data + b" (again)")   # replaces
        finally:
            await pool.close()
    run(go())
    assert target.read_bytes() == data + b" (again)"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700     # created by put_file
    assert stat.S_IMODE((tmp_path / "script.sh").stat().st_mode) == 0o700
    assert sorted(p.name for p in target.parent.iterdir()) == ["secret.env"]   # no temp left


def test_one_connection_is_reused(sshd, tmp_path):
    before = sshd.accepted()

    async def go():
        pool = pool_for(sshd)
        try:
            await pool.run(sshd.host, ["true"])
            t1 = pool._clients[(sshd.host, sshd.port)].get_transport()
            outs = await asyncio.gather(*[pool.run(sshd.host, ["echo", str(i)])
                                          for i in range(12)])   # > MAX_CHANNELS at once
            await pool.put_file(sshd.host, str(tmp_path / "f"), b"x")
            t2 = pool._clients[(sshd.host, sshd.port)].get_transport()
            assert t1 is t2 and t1.is_active() and len(pool._clients) == 1
            assert [o.stdout for o in outs] == [f"{i}\n" for i in range(12)]
        finally:
            await pool.close()
    run(go())
    assert sshd.accepted() - before == 1


def test_a_dead_connection_is_reopened(sshd):
    before = sshd.accepted()

    async def go():
        pool = pool_for(sshd)
        try:
            await pool.run(sshd.host, ["true"])
            pool._clients[(sshd.host, sshd.port)].get_transport().close()   # dies under us
            assert (await pool.run(sshd.host, ["echo", "back"])).stdout == "back\n"
            assert sshd.accepted() - before == 2
            sshd.restart()                          # the server and all its sessions go away
            assert (await pool.run(sshd.host, ["echo", "again"])).stdout == "again\n"
            assert sshd.accepted() - before == 3
        finally:
            await pool.close()
    run(go())


def test_network_trouble_is_transient(sshd):
    async def go():
        pool = pool_for(sshd, port=free_port(), attempts=2)     # nothing listens there
        t0 = time.monotonic()
        with pytest.raises(TransientError, match="attempt 2 of 2"):
            await pool.run(sshd.host, ["true"])
        assert time.monotonic() - t0 < 5
        pool = pool_for(sshd, attempts=1)
        await pool.run(sshd.host, ["true"])
        before = sshd.accepted()
        with pytest.raises(TransientError, match="timed out after 0.5s"):
            await pool.run(sshd.host, ["sleep", "3"], timeout_s=0.5)
        # the connection is still good (a slow command is no broken connection)
        assert (await pool.run(sshd.host, ["echo", "fine"])).stdout == "fine\n"
        assert sshd.accepted() == before
        await pool.close()
    run(go())


# ---- the engine launcher ---------------------------------------------------------------------

ENGINE = textwrap.dedent("""\
    import json, os, signal, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port = int(sys.argv[1])

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                body = b"ok"
            elif self.path == "/env":
                body = json.dumps({"secret": os.environ.get("NS_SECRET"),
                                   "plain": os.environ.get("NS_PLAIN"),
                                   "cwd": os.getcwd(), "argv": sys.argv[1:]}).encode()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    def bye(*_):
        print("engine stopping", flush=True)
        os._exit(3)

    signal.signal(signal.SIGTERM, bye)
    srv = ThreadingHTTPServer(("127.0.0.1", port), H)
    print(f"engine listening on {port}", flush=True)
    srv.serve_forever()
""")

SECRET = "s3cr3t-" + uuid.uuid4().hex + " it's $HOME `id`;"


async def http_json(url: str):
    import aiohttp
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            assert r.status == 200
            return json.loads(await r.read())


async def cleanup(lr: EngineLauncher, host: str, name: str) -> None:
    """No engine outlives its test, even a failed one."""
    try:
        await lr.stop(host, name, grace_s=1)
    except Exception:
        pass


def test_engine_life_cycle(sshd, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    port = free_port()
    workdir = tmp_path / "work"
    name = "vpod-1.decode_a"
    argv = [sys.executable, str(script), str(port), "an arg with spaces"]
    record = {"id": name, "phase": "decode", "labels": {"neuscale-cluster": "t"}}
    url = f"http://127.0.0.1:{port}"

    async def go():
        pool = pool_for(sshd)
        lr = EngineLauncher(pool, str(workdir))
        try:
            assert await lr.status(sshd.host, name) == "unknown"
            assert await lr.logs(sshd.host, name) == ""
            t0 = time.monotonic()
            pid = await lr.start(sshd.host, name, argv, env={"NS_PLAIN": "plain value"},
                                 secret_env={"NS_SECRET": SECRET}, record=record)
            assert time.monotonic() - t0 < 5          # detached: does not wait for the engine
            assert await lr.status(sshd.host, name) == "running"
            await wait_http_ready(url, timeout_s=10)

            checked = []

            async def first_request(base):
                checked.append(await http_json(base + "/env"))
                return True
            await wait_http_ready(url, timeout_s=10, check=first_request)
            seen = checked[0]
            assert seen["secret"] == SECRET and seen["plain"] == "plain value"
            assert seen["cwd"] == str(workdir / name) and seen["argv"][-1] == argv[-1]

            # the secret is on no command line of the host, in no log
            ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
            assert str(script) in ps and "s3cr3t-" not in ps
            log = await lr.logs(sshd.host, name)
            assert f"engine listening on {port}" in log and "s3cr3t-" not in log
            d = workdir / name
            assert stat.S_IMODE((d / "env").stat().st_mode) == 0o600
            assert stat.S_IMODE(d.stat().st_mode) == 0o700
            assert SECRET not in (d / "run.sh").read_text()

            # idempotent by name and argv; another argv while running is refused
            assert await lr.start(sshd.host, name, argv, secret_env={"NS_SECRET": SECRET},
                                  record=record) == pid
            with pytest.raises(ConfigError, match="already runs"):
                await lr.start(sshd.host, name, argv[:-1] + ["other"], record=record)

            info = await lr.inspect(sshd.host, name)
            assert (info.status, info.pid, info.exit_code) == ("running", pid, None)
            listed = await lr.list(sshd.host)
            assert listed == [{**record, "name": name, "status": "running", "pid": pid,
                               "exit_code": None}]

            await lr.stop(sshd.host, name, grace_s=10)
            info = await lr.inspect(sshd.host, name)
            assert (info.status, info.exit_code, info.record) == ("exited", 3, record)
            assert not (d / "pid").exists()
            assert "engine stopping" in await lr.logs(sshd.host, name)
            with pytest.raises(TransientError):
                await wait_http_ready(url, timeout_s=0.3)
            await lr.stop(sshd.host, name)                      # idempotent
            assert (await lr.list(sshd.host))[0]["status"] == "exited"

            # starts again (same directory, log appended)
            pid2 = await lr.start(sshd.host, name, argv, secret_env={"NS_SECRET": SECRET},
                                  record=record)
            assert pid2 != pid and await lr.status(sshd.host, name) == "running"
            await wait_http_ready(url, timeout_s=10)
            await lr.remove(sshd.host, name, grace_s=10)
            assert await lr.status(sshd.host, name) == "unknown"
            assert not d.exists() and await lr.list(sshd.host) == []
            await lr.remove(sshd.host, name)                    # idempotent
        finally:
            await cleanup(lr, sshd.host, name)
            await pool.close()
    run(go())
    assert "run " in caplog.text and "put " in caplog.text    # commands are logged ...
    assert "s3cr3t-" not in caplog.text                         # ... never the secret


def test_stop_kills_what_ignores_sigterm(sshd, tmp_path):
    name = "stubborn"
    # the engine ignores SIGTERM; its child (sleep) too
    argv = ["sh", "-c", "trap '' TERM; echo stubborn up; sleep 60; echo never"]

    async def go():
        pool = pool_for(sshd)
        lr = EngineLauncher(pool, str(tmp_path))
        try:
            pid = await lr.start(sshd.host, name, argv)
            assert await lr.status(sshd.host, name) == "running"
            t0 = time.monotonic()
            await lr.stop(sshd.host, name, grace_s=1)
            took = time.monotonic() - t0
            assert 0.9 < took < 8
            info = await lr.inspect(sshd.host, name)
            assert (info.status, info.exit_code) == ("exited", 137)
            ps = subprocess.run(["ps", "-o", "stat=", "-g", str(pid)], capture_output=True,
                                text=True).stdout.split()
            assert all(s.startswith("Z") for s in ps)        # nothing of the group runs
            assert "stubborn up" in await lr.logs(sshd.host, name)
        finally:
            await cleanup(lr, sshd.host, name)
            await pool.close()
    run(go())


def test_engine_that_exits_at_once(sshd, tmp_path):
    async def go():
        pool = pool_for(sshd)
        lr = EngineLauncher(pool, str(tmp_path))
        try:
            await lr.start(sshd.host, "quick", ["sh", "-c", "echo bye; exit 7"])
            for _ in range(100):
                info = await lr.inspect(sshd.host, "quick")
                if info.status == "exited":
                    break
                await asyncio.sleep(0.05)
            assert (info.status, info.exit_code) == ("exited", 7)
            assert (await lr.logs(sshd.host, "quick")).strip() == "bye"
        finally:
            await cleanup(lr, sshd.host, "quick")
            await pool.close()
    run(go())


def test_launcher_validates_and_resolves_home(sshd, tmp_path):
    async def go():
        pool = pool_for(sshd)
        try:
            lr = EngineLauncher(pool, str(tmp_path))
            for bad in ["", "../x", "a/b", "-x", ".hidden", "x" * 64, "a b", "a;b"]:
                with pytest.raises(ConfigError, match="engine name"):
                    await lr.start(sshd.host, bad, ["true"])
                with pytest.raises(ConfigError, match="engine name"):
                    await lr.remove(sshd.host, bad)
            with pytest.raises(ConfigError, match="argv"):
                await lr.start(sshd.host, "ok", "echo hi")
            with pytest.raises(ConfigError, match="name"):
                await lr.start(sshd.host, "ok", ["true"], env={"1BAD": "x"})
            with pytest.raises(ConfigError) as e:
                await lr.start(sshd.host, "ok", ["true"], env={"K": "a"},
                               secret_env={"K": "s3cr3t-value"})
            assert "s3cr3t" not in str(e.value)
            assert not (tmp_path / "ok").exists()
            assert await pool.home(sshd.host) == os.path.expanduser("~")
            rel = f".neuscale-test-{uuid.uuid4().hex[:8]}"
            assert await EngineLauncher(pool, "~/" + rel)._workdir(sshd.host) == \
                os.path.expanduser("~/" + rel)
            assert await EngineLauncher(pool, rel)._workdir(sshd.host) == \
                os.path.expanduser("~/" + rel)
        finally:
            await pool.close()
    run(go())


def test_wait_http_ready_reports_the_last_error():
    async def go():
        port = free_port()
        t0 = time.monotonic()
        with pytest.raises(TransientError) as e:
            await wait_http_ready(f"http://127.0.0.1:{port}", timeout_s=0.5)
        assert time.monotonic() - t0 < 2
        assert f"127.0.0.1:{port}" in str(e.value) and "ClientConnectorError" in str(e.value)
    run(go())
