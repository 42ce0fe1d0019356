"""The sim cloud: a fake TPU cloud on 127.0.0.1 (design §3).

``python -m backends.sim.cloud --port 0 --time-scale 60 --quota v6e=8,v5p=16 [--model M]
[--db PATH] [--url-file PATH] [--fail-create-every N] [--seed S]``

One process, one event loop: the management API and one engine server
(:class:`backends.sim.engine_server.EngineServer`) per ready vPod, each on its own port. The
process is meant to outlive its client (the controller starts it in its own session): vPods
stay until deleted, and a restarted controller finds them with ``GET /v1/vpods?label=...``.
SIGTERM or SIGINT stops it cleanly (engine servers stopped, ports closed, exit 0); with
``--db`` its vPods are written to a file and a restarted cloud brings them back (engines
restart: engine start and weight load again, no creation delay).

Management API (JSON; errors ``{"error": {"code", "message", ...}}``):

* ``POST /v1/vpods`` (body: a :class:`backends.base.VPodSpec`) -> 201 with the new vPod, 200
  with the existing one for the same id and spec; 409 ``ALREADY_EXISTS`` for the same id with
  another spec (or one being deleted); 429 ``RESOURCE_EXHAUSTED`` (with ``chip``) when the chip
  version's quota (chips held by vPods not yet released) would be exceeded; 400
  ``INVALID_ARGUMENT`` for a bad spec (unknown model or chip, tp*pp*ep != chips, a topology
  that does not hold them, a model that does not fit in HBM, a KV cache smaller than
  max_model_len, max_model_len beyond the model's context); 503 ``UNAVAILABLE`` every N-th
  create with ``--fail-create-every N`` (a test hook: the client retries).
* ``GET /v1/vpods[?label=k=v&label=...][&all=1]`` -> ``{"vpods": [...]}`` (released ones only
  with ``all=1``); ``GET /v1/vpods/{id}[?wait=S]`` (long poll: answers when the vPod leaves
  STARTING or after S seconds, at most 30); ``DELETE /v1/vpods/{id}`` -> DRAINING at once (the
  engine server stops), RELEASED after Table 3's delete time / time scale, when its chips
  return to the quota; ``POST /v1/vpods/{id}/kill`` (test hook: the engine server dies at
  once, connections reset; the vPod stays READY, as a crashed VM does, until deleted);
  ``GET /v1/quotas``; ``GET /health``.

Life cycle: STARTING for Table 3's creation (uniform 73-108 s) + engine start (31 s) + weight
download (the chip's DCN bandwidth) + weight load (24 GB/s per chip) (:func:`sim.lifecycle.
startup`), divided by ``--time-scale``; meanwhile the allocation's step-cost table is built
(or read from the cache); then the engine server listens on a free port and the vPod is READY.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from dse.allocation import parse_allocation
from dse.catalog import Catalog, default_catalog
from dse.costmodel import max_weights_bytes
from dse.errors import NeuScaleError
from dse.files import read_text, write_atomic
from dse.models import ModelArch, load_model
from dse.vpod import VPodState
from sim.chip import ChipModel
from sim.lifecycle import DELETE_S, ENGINE_START_S, LOAD_BW_BYTES_PER_S, startup

from ..base import ConfigError, VPodInfo, VPodSpec
from .engine_server import EngineServer, raise_fd_limit, step_cost_table

log = logging.getLogger("neuscale.sim.cloud")

MAX_WAIT_S = 30.0


class _CloudError(Exception):
    def __init__(self, status: int, code: str, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra

    def response(self) -> web.Response:
        return web.json_response({"error": {"code": self.code, "message": self.message,
                                            **self.extra}}, status=self.status)


@dataclass
class _VPod:
    spec: VPodSpec
    chip: str                  # the catalog's name of spec.chip
    state: VPodState
    created_s: float
    ready_s: float | None = None
    endpoint: str | None = None
    message: str = ""
    port: int | None = None    # the engine server's port (kept to reuse after a restart)
    server: EngineServer | None = None
    task: asyncio.Task | None = None
    changed: asyncio.Event | None = None

    def info(self) -> VPodInfo:
        return VPodInfo(self.spec, self.state, self.endpoint, self.created_s, self.ready_s,
                        self.message)

    def to_json(self) -> dict[str, Any]:
        return {**self.info().to_json(), "port": self.port}


def parse_quotas(text: str, catalog: Catalog) -> dict[str, int]:
    """``v6e=8,v5p=16`` -> {chip name: chips}; names resolve through the catalog."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, val = part.partition("=")
        if not sep:
            raise NeuScaleError(f"--quota: {part!r} is not CHIP=CHIPS")
        chip = catalog.get(name.strip()).name
        try:
            n = int(val)
        except ValueError:
            raise NeuScaleError(f"--quota: {val!r} is not a whole number of chips") from None
        if n < 0:
            raise NeuScaleError(f"--quota: {chip} has a negative quota")
        if chip in out:
            raise NeuScaleError(f"--quota: chip {chip} named twice")
        out[chip] = n
    return out


class SimCloud:
    """The fake cloud (see the module docstring)."""

    def __init__(self, *, time_scale: float = 60.0, quotas: dict[str, int] | None = None,
                 catalog: Catalog | None = None, model: str | None = None,
                 fail_create_every: int = 0, seed: int = 0, db_path: str | Path | None = None,
                 max_batched_tokens: int = 8192, host: str = "127.0.0.1", stack=None):
        """``stack``: the serving-stack profile every engine runs (a name or a JSON profile,
        :func:`dse.stacks.parse_stack`; default ``vllm-tpu``) - a test or what-if may make
        the engines slower than the database assumed."""
        if not time_scale > 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = float(time_scale)
        self.quotas = dict(quotas or {})
        self.catalog = catalog or default_catalog()
        self.model = model
        self.fail_create_every = int(fail_create_every)
        self.rng = np.random.default_rng(seed)
        self.db_path = Path(db_path) if db_path else None
        self.max_batched_tokens = max_batched_tokens
        self.host = host
        from dse.stacks import parse_stack
        self.stack = parse_stack(stack)
        self.vpods: dict[str, _VPod] = {}
        self._archs: dict[str, ModelArch] = {}
        self._tables: dict[tuple, asyncio.Future] = {}
        self._creates = 0
        self._runner: web.AppRunner | None = None
        self._stopping = False
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- start and stop -----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/health", self._health)
        r.add_post("/v1/vpods", self._create)
        r.add_get("/v1/vpods", self._list)
        r.add_get("/v1/vpods/{id}", self._get)
        r.add_delete("/v1/vpods/{id}", self._delete)
        r.add_post("/v1/vpods/{id}/kill", self._kill)
        r.add_get("/v1/quotas", self._quotas)
        return app

    async def start(self, port: int = 0) -> int:
        self._restore()
        self._runner = web.AppRunner(self.app(), handle_signals=False, access_log=None,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        """Stop every engine server and the management API (vPods are not deleted: with
        ``--db`` a restarted cloud brings them back)."""
        self._stopping = True
        tasks = [v.task for v in self.vpods.values() if v.task is not None and not v.task.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(v.server.stop() for v in self.vpods.values()
                               if v.server is not None), return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- persistence --------------------------------------------------------------------------
    def _save(self) -> None:
        if self.db_path is None or self._stopping:
            return
        data = {"format": 1, "vpods": [v.to_json() for v in self.vpods.values()]}
        try:
            write_atomic(self.db_path, json.dumps(data, indent=1))
        except OSError as e:
            log.warning("cannot write %s: %s", self.db_path, e)

    def _restore(self) -> None:
        if self.db_path is None or not self.db_path.exists():
            return
        data = json.loads(read_text(self.db_path, "sim cloud state"))
        for d in data.get("vpods", []):
            info = VPodInfo.from_json(d)
            if info.state == VPodState.RELEASED:
                self.vpods[info.spec.id] = _VPod(info.spec, d.get("chip") or info.spec.chip,
                                                 info.state, info.created_s, info.ready_s,
                                                 None, info.message)
                continue
            try:
                arch, chip, par = self._validate(info.spec)
            except _CloudError as e:
                self.vpods[info.spec.id] = _VPod(info.spec, info.spec.chip, VPodState.RELEASED,
                                                 info.created_s, info.ready_s, None,
                                                 f"not restored: {e.message}")
                continue
            v = _VPod(info.spec, chip.name, VPodState.STARTING, info.created_s, None, None,
                      "restarting after a cloud restart", d.get("port"),
                      changed=asyncio.Event())
            self.vpods[v.spec.id] = v
            if info.state == VPodState.DRAINING:
                v.state = VPodState.DRAINING
                v.task = asyncio.get_running_loop().create_task(self._release_later(v))
                continue
            shard = max_weights_bytes(arch, par)
            delay = (ENGINE_START_S + shard / LOAD_BW_BYTES_PER_S) / self.time_scale
            v.task = asyncio.get_running_loop().create_task(self._bring_up(v, arch, delay))

    # ---- validation ---------------------------------------------------------------------------
    def _arch(self, model: str) -> ModelArch:
        a = self._archs.get(model)
        if a is None:
            a = self._archs[model] = load_model(model)
        return a

    def _validate(self, spec: VPodSpec):
        probs = spec.problems()
        if probs:
            raise _CloudError(400, "INVALID_ARGUMENT", "; ".join(probs))
        if self.model is not None and spec.model != self.model:
            raise _CloudError(400, "INVALID_ARGUMENT", f"this cloud serves model "
                              f"{self.model!r}, not {spec.model!r}")
        try:
            arch = self._arch(spec.model)
            arch, chip, topo, par = parse_allocation(self.catalog, arch, spec.chip,
                                                     spec.num_chips, spec.topology, spec.tp,
                                                     spec.pp, spec.ep, spec.attn)
        except (NeuScaleError, ValueError) as e:
            raise _CloudError(400, "INVALID_ARGUMENT", str(e)) from None
        cm = ChipModel(arch, chip, topo, par)
        kv = cm.kv_capacity_tokens()
        if kv <= 0:
            raise _CloudError(400, "INVALID_ARGUMENT", f"{arch.name} does not fit on "
                              f"{spec.num_chips} {chip.name} chip(s) with {par}: "
                              f"{cm.weights_bytes() / 1e9:.1f} GB of weights per chip, "
                              f"{chip.hbm_bytes / 1e9:.1f} GB of HBM; use more chips")
        if arch.max_context and spec.max_model_len > arch.max_context:
            raise _CloudError(400, "INVALID_ARGUMENT", f"max_model_len {spec.max_model_len} is "
                              f"beyond {arch.name}'s context of {arch.max_context} tokens")
        per_engine = kv // max(1, spec.pp)
        if per_engine < spec.max_model_len:
            raise _CloudError(400, "INVALID_ARGUMENT", f"max_model_len {spec.max_model_len} is "
                              f"larger than the {per_engine} tokens the KV cache of {par} on "
                              f"{chip.name} holds per engine; lower max_model_len or use "
                              f"more chips")
        return arch, chip, par

    def _used(self, chip: str) -> int:
        return sum(v.spec.num_chips for v in self.vpods.values()
                   if v.chip == chip and v.state != VPodState.RELEASED)

    # ---- handlers -----------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _create(self, request: web.Request) -> web.Response:
        try:
            return await self._create_inner(request)
        except _CloudError as e:
            return e.response()

    async def _create_inner(self, request: web.Request) -> web.Response:
        self._creates += 1
        if self.fail_create_every and self._creates % self.fail_create_every == 0:
            raise _CloudError(503, "UNAVAILABLE", "the service is busy; try again "
                              "(--fail-create-every)")
        try:
            body = json.loads(await request.read())
            spec = VPodSpec.from_json(body)
        except ValueError:
            raise _CloudError(400, "INVALID_ARGUMENT", "the body is not JSON") from None
        except ConfigError as e:
            raise _CloudError(400, "INVALID_ARGUMENT", str(e)) from None
        old = self.vpods.get(spec.id)
        if old is not None and old.state != VPodState.RELEASED:
            if old.spec != spec:
                diff = [k for k, a in spec.to_json().items() if old.spec.to_json()[k] != a]
                raise _CloudError(409, "ALREADY_EXISTS", f"vPod {spec.id!r} exists with "
                                  f"another spec (differs in {', '.join(diff)})")
            if old.state == VPodState.DRAINING:
                raise _CloudError(409, "ALREADY_EXISTS", f"vPod {spec.id!r} is being deleted")
            return web.json_response(old.info().to_json(), status=200)
        arch, chip, par = self._validate(spec)
        limit = self.quotas.get(chip.name)
        if limit is not None:
            used = self._used(chip.name)
            if used + spec.num_chips > limit:
                raise _CloudError(429, "RESOURCE_EXHAUSTED", f"quota exceeded for {chip.name}: "
                                  f"{used} of {limit} chips in use, {spec.num_chips} more "
                                  f"asked", chip=chip.name, limit=limit, used=used)
        st = startup(chip, max_weights_bytes(arch, par), self.rng)
        v = _VPod(spec, chip.name, VPodState.STARTING, time.time(), changed=asyncio.Event())
        self.vpods[spec.id] = v
        v.task = asyncio.get_running_loop().create_task(
            self._bring_up(v, arch, st.total_s / self.time_scale))
        self._save()
        log.info("creating %s (%s %s, ready in %.2f s)", spec.id, chip.name, spec.topology,
                 st.total_s / self.time_scale)
        return web.json_response(v.info().to_json(), status=201)

    async def _table(self, arch: ModelArch, spec: VPodSpec):
        key = (arch.fingerprint(), spec.chip, spec.topology, spec.tp, spec.pp, spec.ep,
               spec.attn)
        fut = self._tables.get(key)
        if fut is None:
            fut = self._tables[key] = asyncio.ensure_future(asyncio.to_thread(
                step_cost_table, arch, self.catalog, spec.chip, spec.topology, spec.tp,
                spec.pp, spec.ep, self.stack, spec.attn))
        try:
            return await asyncio.shield(fut)
        except Exception:
            self._tables.pop(key, None)
            raise

    async def _bring_up(self, v: _VPod, arch: ModelArch, delay_s: float) -> None:
        """STARTING -> READY: the scaled start-up delay (the table is built meanwhile), then
        the engine server listens."""
        spec = v.spec
        try:
            table, _ = await asyncio.gather(self._table(arch, spec), asyncio.sleep(delay_s))
            chip = self.catalog.get(spec.chip)
            srv = EngineServer(served_model=spec.model, arch=arch, table=table,
                               phase=spec.phase, max_batch=spec.max_batch, pp=spec.pp,
                               max_model_len=spec.max_model_len,
                               max_batched_tokens=self.max_batched_tokens, vpod_id=spec.id,
                               dcn_bytes_per_s=chip.dcn_bw_bytes_per_s * spec.num_chips,
                               host=self.host)
            port = v.port or 0                   # after a cloud restart: the same port
            try:
                await srv.start(port)
            except asyncio.CancelledError:
                await srv.stop()
                raise
            except OSError:
                await srv.stop()
                if not port:
                    raise
                srv = EngineServer(served_model=spec.model, arch=arch, table=table,
                                   phase=spec.phase, max_batch=spec.max_batch, pp=spec.pp,
                                   max_model_len=spec.max_model_len,
                                   max_batched_tokens=self.max_batched_tokens,
                                   vpod_id=spec.id,
                                   dcn_bytes_per_s=chip.dcn_bw_bytes_per_s * spec.num_chips,
                                   host=self.host)
                await srv.start(0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a vPod that cannot start is reported, not fatal
            log.exception("vPod %s failed to start", spec.id)
            v.state, v.message = VPodState.RELEASED, f"failed to start: {e}"
            v.changed.set()
            self._save()
            return
        if v.state != VPodState.STARTING:        # deleted meanwhile
            await srv.stop()
            return
        v.server, v.port, v.endpoint = srv, srv.port, srv.url
        v.state, v.ready_s, v.message = VPodState.READY, time.time(), ""
        v.changed.set()
        self._save()
        log.info("%s ready at %s", spec.id, srv.url)

    async def _release_later(self, v: _VPod) -> None:
        await asyncio.sleep(DELETE_S / self.time_scale)
        v.state = VPodState.RELEASED
        v.endpoint = None
        v.changed.set()
        self._save()
        log.info("%s released", v.spec.id)

    def _find(self, request: web.Request) -> _VPod:
        vid = request.match_info["id"]
        v = self.vpods.get(vid)
        if v is None:
            raise _CloudError(404, "NOT_FOUND", f"no vPod {vid!r}")
        return v

    async def _list(self, request: web.Request) -> web.Response:
        labels: dict[str, str] = {}
        for item in request.query.getall("label", []):
            k, sep, val = item.partition("=")
            if not sep:
                return _CloudError(400, "INVALID_ARGUMENT", f"label filter {item!r} is not "
                                   "KEY=VALUE").response()
            labels[k] = val
        everything = request.query.get("all") in ("1", "true")
        out = [v.info().to_json() for v in self.vpods.values()
               if v.spec.matches(labels) and (everything or v.state != VPodState.RELEASED)]
        return web.json_response({"vpods": out})

    async def _get(self, request: web.Request) -> web.Response:
        try:
            v = self._find(request)
        except _CloudError as e:
            return e.response()
        try:
            wait = min(float(request.query.get("wait", 0) or 0), MAX_WAIT_S)
        except ValueError:
            return _CloudError(400, "INVALID_ARGUMENT", "wait must be a number").response()
        if wait > 0 and v.state == VPodState.STARTING:
            v.changed.clear()
            try:
                await asyncio.wait_for(v.changed.wait(), wait)
            except asyncio.TimeoutError:
                pass
        return web.json_response(v.info().to_json())

    async def _delete(self, request: web.Request) -> web.Response:
        try:
            v = self._find(request)
        except _CloudError as e:
            return e.response()
        if v.state in (VPodState.STARTING, VPodState.READY):
            if v.task is not None and not v.task.done():
                v.task.cancel()
            v.state, v.endpoint, v.message = VPodState.DRAINING, None, "deleting"
            v.changed.set()
            srv, v.server = v.server, None
            if srv is not None:
                await srv.stop()
            v.task = asyncio.get_running_loop().create_task(self._release_later(v))
            self._save()
            log.info("deleting %s", v.spec.id)
        return web.json_response(v.info().to_json())

    async def _kill(self, request: web.Request) -> web.Response:
        try:
            v = self._find(request)
        except _CloudError as e:
            return e.response()
        if v.state != VPodState.READY or v.server is None:
            return _CloudError(409, "FAILED_PRECONDITION", f"vPod {v.spec.id!r} has no running "
                               f"engine ({v.state.value})").response()
        v.server.kill()
        v.message = "engine crashed (kill hook)"
        self._save()
        return web.json_response(v.info().to_json())

    async def _quotas(self, request: web.Request) -> web.Response:
        chips = sorted(set(self.quotas) | {v.chip for v in self.vpods.values()})
        return web.json_response({"quotas": {c: {"limit": self.quotas.get(c),
                                                 "used": self._used(c)} for c in chips}})


# ---- the command ------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m backends.sim.cloud",
                                 description="A simulated TPU cloud on 127.0.0.1: vPods with "
                                             "Table 3's (time-scaled) delays, quotas, and a "
                                             "simulated vLLM engine server per vPod.")
    ap.add_argument("--port", type=int, default=0, help="management port (0: a free one)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model", default=None,
                    help="the only model vPods may serve (default: any preset or config)")
    ap.add_argument("--time-scale", type=float, default=60.0,
                    help="divide Table 3's delays by this (default 60: minutes become seconds)")
    ap.add_argument("--quota", default="", help="chips per version, e.g. v6e=8,v5p=16 "
                                                "(a version not named is unlimited)")
    ap.add_argument("--db", default=None, help="keep the vPods in this file across restarts")
    ap.add_argument("--url-file", default=None,
                    help="write the management URL here once listening")
    ap.add_argument("--fail-create-every", type=int, default=0,
                    help="test hook: every N-th create answers 503")
    ap.add_argument("--seed", type=int, default=0, help="seed of the creation delays")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--chip-file", action="append", default=[],
                    help="add chips from a JSON/YAML file (repeatable)")
    ap.add_argument("--stack", default=None,
                    help="serving-stack profile the engines run: a name or a JSON profile "
                         "(default vllm-tpu; the database's profile is what the policy assumes)")
    ap.add_argument("--log-level", default="WARNING")
    return ap


async def _run(args: argparse.Namespace) -> None:
    catalog = default_catalog(args.chip_file)
    quotas = parse_quotas(args.quota, catalog)
    if args.model is not None:
        load_model(args.model)
    cloud = SimCloud(time_scale=args.time_scale, quotas=quotas, catalog=catalog,
                     model=args.model, fail_create_every=args.fail_create_every,
                     seed=args.seed, db_path=args.db,
                     max_batched_tokens=args.max_num_batched_tokens, host=args.host,
                     stack=args.stack)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await cloud.start(args.port)
    if args.url_file:
        write_atomic(Path(args.url_file), cloud.url + "\n")
    try:
        print(cloud.url, flush=True)
    except OSError:
        pass                       # nobody reads stdout: the URL file says it
    await stop.wait()
    await cloud.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.time_scale <= 0:
        print("error: --time-scale must be > 0", file=sys.stderr)
        return 2
    if args.fail_create_every < 0:
        print("error: --fail-create-every must be >= 0", file=sys.stderr)
        return 2
    logging.raiseExceptions = False       # a parent that went away must not kill us by stderr
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(name)s: %(message)s")
    raise_fd_limit()
    try:
        asyncio.run(_run(args))
    except NeuScaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
