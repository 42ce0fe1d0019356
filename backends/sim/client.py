"""The simulated backend's client: :class:`SimBackend` talks to a sim cloud
(:mod:`backends.sim.cloud`) over HTTP; :class:`CloudProcess` starts one as a child process in
its own session (so it outlives its parent, as a cloud does) and stops it.

Error mapping (the :mod:`backends.base` contract): a connection error, a timeout or a 5xx is a
:class:`~backends.base.TransientError`; 429 is a :class:`~backends.base.QuotaError` naming the
chip; 400 and 409 are :class:`~backends.base.ConfigError` with the cloud's message.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import aiohttp

from dse.vpod import VPodState

from ..base import (Backend, BackendError, ConfigError, QuotaError, TransientError, VPodInfo,
                    VPodSpec)


class SimBackend(Backend):
    """A :class:`~backends.base.Backend` on a sim cloud at ``url``
    (``http://127.0.0.1:PORT``). One aiohttp session, opened on first use in the running
    loop."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, poll_s: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- plumbing -----------------------------------------------------------------------------
    def _sess(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout_s))
            self._loop = loop
        return self._session

    async def _call(self, method: str, path: str, *, body: Any = None,
                    params: Any = None, timeout_s: float | None = None) -> tuple[int, Any]:
        """(status, JSON body) of a call; connection trouble, timeouts and 5xx raise
        TransientError, 429 QuotaError, 400/409 ConfigError; other statuses are returned."""
        t = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._sess().request(method, self.url + path, json=body, params=params,
                                            timeout=t) as r:
                try:
                    data = await r.json(content_type=None)
                except ValueError:
                    data = None
                status = r.status
        except asyncio.TimeoutError:
            raise TransientError(f"the sim cloud at {self.url} did not answer {method} {path} "
                                 "in time") from None
        except aiohttp.ClientError as e:
            raise TransientError(f"cannot reach the sim cloud at {self.url}: {e}") from None
        err = data.get("error") if isinstance(data, dict) else None
        err = err if isinstance(err, dict) else {}
        msg = str(err.get("message") or f"HTTP {status}")
        if status >= 500:
            raise TransientError(f"sim cloud: {msg}")
        if status == 429:
            raise QuotaError(f"sim cloud: {msg}", chip=err.get("chip"))
        if status in (400, 409):
            raise ConfigError(f"sim cloud: {msg}")
        return status, data

    # ---- the interface ------------------------------------------------------------------------
    async def create(self, spec: VPodSpec) -> VPodInfo:
        status, data = await self._call("POST", "/v1/vpods", body=spec.to_json())
        if status not in (200, 201):
            raise BackendError(f"sim cloud: create answered HTTP {status}")
        return VPodInfo.from_json(data)

    async def delete(self, vpod_id: str) -> None:
        status, _ = await self._call("DELETE", f"/v1/vpods/{vpod_id}")
        if status not in (200, 404):
            raise BackendError(f"sim cloud: delete answered HTTP {status}")

    async def list(self, labels: Mapping[str, str] = {}) -> list[VPodInfo]:
        params = [("label", f"{k}={v}") for k, v in labels.items()]
        status, data = await self._call("GET", "/v1/vpods", params=params)
        if status != 200 or not isinstance(data, dict):
            raise TransientError(f"sim cloud: list answered HTTP {status}")
        return [VPodInfo.from_json(d) for d in data.get("vpods", [])]

    async def get(self, vpod_id: str) -> VPodInfo | None:
        status, data = await self._call("GET", f"/v1/vpods/{vpod_id}")
        if status == 404:
            return None
        return VPodInfo.from_json(data)

    async def wait_ready(self, vpod_id: str, timeout_s: float) -> VPodInfo:
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransientError(f"vPod {vpod_id} not ready after {timeout_s:g} s")
            wait = max(0.0, min(left, self.poll_s))
            try:
                status, data = await self._call("GET", f"/v1/vpods/{vpod_id}",
                                                params={"wait": f"{wait:.3f}"},
                                                timeout_s=wait + self.timeout_s)
            except TransientError:
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 1.0)
                continue
            if status == 404:
                raise BackendError(f"vPod {vpod_id} does not exist")
            info = VPodInfo.from_json(data)
            if info.state == VPodState.READY:
                return info
            if info.state in (VPodState.DRAINING, VPodState.RELEASED):
                raise BackendError(f"vPod {vpod_id} is {info.state.value}"
                                   + (f": {info.message}" if info.message else ""))

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # ---- extras (sim only) --------------------------------------------------------------------
    async def kill(self, vpod_id: str) -> VPodInfo:
        """Test hook: the vPod's engine server dies at once (connections reset)."""
        status, data = await self._call("POST", f"/v1/vpods/{vpod_id}/kill")
        if status != 200:
            raise BackendError(f"sim cloud: kill answered HTTP {status}")
        return VPodInfo.from_json(data)

    async def quotas(self) -> dict[str, dict[str, int | None]]:
        """{chip: {"limit": chips or None, "used": chips}}."""
        _, data = await self._call("GET", "/v1/quotas")
        return dict(data.get("quotas", {}))


class CloudProcess:
    """A sim cloud running as a child process in its own session (it survives its parent and
    ignores the parent's Ctrl-C). :meth:`start` waits until it listens."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc = proc
        self.url = url

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, args: Sequence[str] = (), *, timeout_s: float = 60.0,
              stderr: Any = None, env: Mapping[str, str] | None = None) -> "CloudProcess":
        """``python -m backends.sim.cloud --port 0 ARGS`` (``args`` may set ``--port``);
        returns once its URL is known. :class:`BackendError` if it exits or stays silent
        for ``timeout_s``."""
        root = str(Path(__file__).resolve().parents[2])
        e = dict(os.environ if env is None else env)
        e["PYTHONPATH"] = root + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
        with tempfile.TemporaryDirectory(prefix="neuscale-cloud-") as d:
            url_file = Path(d) / "url"
            argv = [sys.executable, "-m", "backends.sim.cloud"]
            if "--port" not in args:
                argv += ["--port", "0"]
            argv += [*args, "--url-file", str(url_file)]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=stderr, env=e, start_new_session=True)
            deadline = time.monotonic() + timeout_s
            while True:
                if url_file.exists():
                    url = url_file.read_text().strip()
                    if url:
                        return cls(proc, url)
                code = proc.poll()
                if code is not None:
                    raise BackendError(f"the sim cloud exited with status {code} before "
                                       f"listening ({' '.join(argv[1:])})")
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise BackendError(f"the sim cloud did not listen within {timeout_s:g} s")
                time.sleep(0.02)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


__all__ = ["SimBackend", "CloudProcess"]
