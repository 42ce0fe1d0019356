"""Engines on remote hosts: install/verify vLLM, fetch weights, start the engine (and the Ray
processes of a multi-host slice) over SSH, wait for readiness, stop, read logs.

Shared by the Cloud TPU backend (hosts = a slice's workers) and the static backend (hosts that
already exist). The command lines come from :mod:`backends.engine`; the SSH connections and the
detached processes from :mod:`backends.ssh` and :mod:`backends.launcher`.

Readiness = ``/health`` answers 200 and a first tiny completion succeeds (the first request is
what compiles the graphs on TPU; the engine is not routed to before it). While waiting, an
engine process that exits is noticed at once and reported with the tail of its log instead of
waiting out the timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import Any, Mapping, Sequence

import aiohttp

from .base import BackendError, ConfigError, VPodSpec
from .engine import (EngineSettings, VLLM_API_KEY_VAR, engine_env, fetch_weights_script,
                     host_plan, secret_env)
from .launcher import EngineLauncher, wait_http_ready
from .ssh import SSHPool, SSHSettings

log = logging.getLogger("neuscale.backends.remote")


class RemoteEngines:
    """Starts and stops one vPod's processes on its hosts."""

    def __init__(self, ssh: SSHSettings, engine: EngineSettings,
                 environ: Mapping[str, str] | None = None, pool: SSHPool | None = None):
        self.ssh = ssh
        self.engine = engine
        self.pool = pool or SSHPool(ssh)
        self.launcher = EngineLauncher(self.pool, workdir=engine.workdir)
        self._secrets = secret_env(engine, os.environ if environ is None else environ)
        self.api_key = self._secrets.get(VLLM_API_KEY_VAR)
        self._homes: dict[str, str] = {}
        self._prepared: set[str] = set()

    def trust(self, trusted: Mapping[str, Sequence[str]] | None) -> None:
        if trusted:
            self.pool.trust(trusted)

    async def _settings_for(self, host: str, port: int | None) -> EngineSettings:
        """The engine settings with ``~`` resolved to the host's home (vLLM's arguments are
        passed quoted, so no shell expands them)."""
        s = self.engine if port is None else replace(self.engine, port=port)
        if not s.workdir.startswith("~"):
            return s
        home = self._homes.get(host)
        if home is None:
            home = await self.pool.home(host)
            if not home.startswith("/"):
                raise BackendError(f"{host}: cannot find the SSH user's home ($HOME={home!r})")
            self._homes[host] = home
        wd = home + s.workdir[1:]
        model = s.model
        if model.startswith("~/"):
            model = home + model[1:]
        return replace(s, workdir=wd, model=model)

    async def prepare(self, host: str, settings: EngineSettings) -> None:
        """vLLM installed (``engine.check``, else ``engine.install``) and the weights there."""
        if host in self._prepared:
            return
        r = await self.pool.run_shell(host, settings.check, timeout_s=300, check=False)
        if r.rc != 0:
            log.info("%s: installing vLLM (%s)", host, settings.install)
            r = await self.pool.run_shell(host, settings.install,
                                          timeout_s=settings.ready_timeout_s, check=False)
            if r.rc != 0:
                raise BackendError(f"{host}: engine.install failed (exit {r.rc}): "
                                   f"{_tail(r.stderr or r.stdout)}")
            r = await self.pool.run_shell(host, settings.check, timeout_s=300, check=False)
            if r.rc != 0:
                raise ConfigError(f"{host}: engine.check still fails after engine.install: "
                                  f"{_tail(r.stderr or r.stdout)}")
        script = fetch_weights_script(settings)
        if script:
            r = await self.pool.run_shell(host, script, timeout_s=settings.ready_timeout_s,
                                          check=False)
            if r.rc != 0:
                raise BackendError(f"{host}: fetching the weights {settings.model} failed: "
                                   f"{_tail(r.stderr or r.stdout)}")
        self._prepared.add(host)

    def endpoint(self, workers: Sequence[str], port: int | None = None) -> str:
        return f"http://{_url_host(workers[0])}:{port or self.engine.port}"

    def commands(self, spec: VPodSpec, workers: Sequence[str],
                 settings: EngineSettings | None = None, slice_chips: int | None = None):
        s = settings or self.engine
        return host_plan(spec, workers, s), engine_env(spec, s, slice_chips)

    async def launch(self, spec: VPodSpec, workers: Sequence[str], *,
                     trusted: Mapping[str, Sequence[str]] | None = None,
                     port: int | None = None, record: Mapping[str, Any] | None = None,
                     slice_chips: int | None = None) -> str:
        """Start the vPod's processes and wait until it serves; its endpoint URL."""
        if not workers:
            raise ConfigError(f"vPod {spec.id}: no host to run on")
        self.trust(trusted)
        t0 = time.monotonic()
        settings = await self._settings_for(workers[0], port)
        await asyncio.gather(*(self.prepare(w, settings) for w in workers))
        plan, env = self.commands(spec, workers, settings, slice_chips)
        for host, name, argv in plan:
            main = name == spec.id
            await self.launcher.start(
                host, name, argv, env=env, secret_env=self._secrets if main else {},
                record={**(record or {}), "vpod": spec.id,
                        "spec": spec.to_json() if main else None,
                        "role": "engine" if main else "ray",
                        "endpoint": self.endpoint(workers, settings.port) if main else None})
        url = self.endpoint(workers, settings.port)
        await self.wait_ready(spec, workers[0], url, settings.ready_timeout_s
                              - (time.monotonic() - t0))
        log.info("%s serves at %s (%.0f s after launch)", spec.id, url, time.monotonic() - t0)
        return url

    async def wait_ready(self, spec: VPodSpec, host: str, url: str, timeout_s: float) -> None:
        """Until ``/health`` answers and a first tiny completion succeeds; an engine process
        that exits meanwhile ends the wait with the tail of its log."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.engine.served_model_name or spec.model, "prompt": "Hello",
                "max_tokens": 1}

        async def first_completion(base: str) -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                async with s.post(base + "/v1/completions", json=body, headers=headers) as c:
                    if c.status != 200:
                        raise BackendError(f"first completion answered {c.status}: "
                                           f"{(await c.text())[:200]}")

        async def still_running() -> None:
            if await self.launcher.status(host, spec.id) != "running":
                tail = await self.launcher.logs(host, spec.id, lines=30)
                raise BackendError(f"vPod {spec.id}: the engine on {host} exited before it "
                                   f"was ready; its log ends:\n{tail}")

        await wait_http_ready(url, timeout_s=max(timeout_s, 1.0), check=first_completion,
                              watch=still_running)

    async def stop(self, spec: VPodSpec, workers: Sequence[str]) -> None:
        """Stop the engine, then the Ray processes; their directories (logs) are removed."""
        if not workers:
            return
        await self.launcher.remove(workers[0], spec.id)
        if len(workers) > 1:
            await asyncio.gather(*(self.launcher.remove(w, f"{spec.id[:55]}.ray") for w in workers),
                                 return_exceptions=True)

    async def logs(self, spec: VPodSpec, workers: Sequence[str], *, lines: int = 200,
                   trusted: Mapping[str, Sequence[str]] | None = None) -> str:
        self.trust(trusted)
        return await self.launcher.logs(workers[0], spec.id, lines=lines)

    async def records(self, host: str) -> list[dict[str, Any]]:
        """The engine records on ``host`` (what runs there, for a restarted controller)."""
        return [r for r in await self.launcher.list(host) if r.get("spec")]

    async def close(self) -> None:
        await self.pool.close()


def _tail(text: str, n: int = 8) -> str:
    lines = [x for x in (text or "").strip().splitlines() if x.strip()]
    return " | ".join(lines[-n:]) or "(no output)"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


__all__ = ["RemoteEngines"]
