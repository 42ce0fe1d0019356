"""vLLM's OpenAI HTTP surface around the simulated engines of one vPod, in real time.

One :class:`EngineServer` per vPod (the sim cloud runs many on one event loop; ``python -m
backends.sim.engine_server`` runs one alone). It serves ``/health``, ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` (streaming and not) and ``/metrics`` (vLLM's
metric names), with the P/D hand-off and continuation convention of ``kv_transfer_params``
(design §1). Output text and lengths come from :mod:`backends.sim.text` (deterministic, vLLM's
rules for ``max_tokens``, ``min_tokens``, ``ignore_eos``, ``stop``); prompt tokens are counted
with :func:`dse.tokens.count_tokens`, as the gateway counts them.

**Time.** The engines (:func:`sim.vpod.vpod_engines` on the allocation's
:class:`sim.stepcost.StepCostTable`) run on the wall clock: engine time is seconds since the
server started (the event loop's monotonic clock). One driver task per server alternates
``advance_to(now)`` on every engine and a sleep until the next thing that can change what a
client sees: the engines' ``next_event_time()`` (a prefill step or a run of decode steps
ends), a finish whose step ends after ``now`` (held until then), a new request (the handler
wakes the driver), and - while streams are open - the next *tick* (20 ms, growing to 50 ms
with 1000 open streams). Tokens are therefore produced at the chip model's pace; a client sees
them at most one tick late, and a finish (the last token, a prefill's first token) exactly on
time. ``tokens_out(record, now)`` of the engines tells how many tokens of a request exist now.

**Batching per tick.** Per tick the driver does O(open requests) arithmetic and wakes only the
handlers whose request has new tokens; each handler writes ONE SSE chunk carrying every token
produced since its previous chunk (vLLM's stream interval), so 1000 streams cost 1000 small
writes per tick, not one per token, and other requests (``/health``) are served between them.

**Requests.** A request is scheduled by what its ``kv_transfer_params`` say:

* ``{"do_remote_decode": true}``: prefill only (the output is capped at one token); the answer
  carries ``kv_transfer_params`` for the decode vPod (``do_remote_prefill``, this vPod's id,
  host and port, ``kv_tokens``, ``kv_bytes``, ``dcn_bytes_per_s``);
* ``{"do_remote_prefill": true, ..., "generated_tokens": k}``: the KV of the prompt and ``k``
  output tokens comes from another vPod: the transfer is charged (:func:`sim.lifecycle.
  kv_transfer_s` at the slower of the two DCN bandwidths), then the request joins the decode
  batch and produces tokens ``k, k+1, ...``;
* anything else (no KV anywhere; ``generated_tokens: k`` alone means the KV was lost and is
  recomputed): the prompt (and the ``k`` tokens) is prefilled here, then decoded here.

A vPod has the engines of its phase; a request that needs the other phase as well (a plain
request to a prefill or a decode vPod, as a vLLM instance serves it) gets that phase's engines
built on the same step-cost table on first use, and the two are simulated as separate hardware
(their contention is not modelled). The response text holds only the new tokens;
``usage.completion_tokens`` counts all of them (``k`` + new).

**Disconnects.** A client that goes away (a disconnect, or a gateway closing a stream to migrate
it to another vPod) has its request aborted in the engines, as vLLM aborts it: the engines are
brought to now, the request leaves its queue or its batch (the slot and its KV blocks are free
at once for the next request) and ``vllm:request_success_total{finished_reason="abort"}``
counts it. A disconnect is normal: it is handled quietly (no traceback in the log).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import itertools
import json
import logging
import math
import os
import signal
import sys
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dse.catalog import Catalog, default_catalog
from dse.errors import NeuScaleError
from dse.models import ModelArch, load_model
from dse.tokens import chat_prompt, count_tokens
from sim.lifecycle import kv_transfer_s
from sim.stepcost import StepCostTable
from sim.vpod import VPodEngines, vpod_engines

from .text import OutputPlan, plan_output

log = logging.getLogger("neuscale.sim.engine")

DEFAULT_COMPLETION_MAX_TOKENS = 16        # vLLM's (and OpenAI's) default for /v1/completions
TICK_MIN_S = 0.02                          # stream interval with few open streams
TICK_MAX_S = 0.05                          # ... and with TICK_STREAMS or more
TICK_STREAMS = 1000
WAKE_BATCH = 100                           # stream handlers woken per loop iteration
ADMIT_BATCH = 64                           # new requests taken in per loop iteration
_BLOCK_TOKENS = 16                         # the engines' KV block (their default)
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


class BadRequest(Exception):
    """An OpenAI-format error answer."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = \
            status, message, param, code, type

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
        return web.Response(status=self.status, body=_dumps(body).encode(),
                            content_type="application/json")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(d: dict, key: str, lo: int) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise BadRequest(400, f"'{key}' must be an integer", param=key)
    if v < lo:
        raise BadRequest(400, f"'{key}' must be at least {lo}, got {v}", param=key)
    return v


def _opt_bool(d: dict, key: str) -> bool:
    v = d.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(400, f"'{key}' must be a boolean", param=key)
    return v


class _Parsed:
    __slots__ = ("chat", "prompt", "prompt_tokens", "max_tokens", "min_tokens", "ignore_eos",
                 "stop", "seed", "stream", "include_usage", "continuous", "kv")


class _Req:
    """One request on this server: its output plan and where its tokens are made."""

    __slots__ = ("id", "chat", "created", "plan", "prompt_tokens", "k0", "total", "pre_eng",
                 "pre_rec", "dec_eng", "dec_rec", "dec_base", "needs_decode", "visible",
                 "sent", "waiter", "done", "cancelled", "stream", "continuous",
                 "include_usage", "t_arrive", "t_first", "kv_out", "failed")

    def __init__(self, rid: str, chat: bool, plan: OutputPlan, prompt_tokens: int, k0: int,
                 total: int, t_arrive: float):
        self.id = rid
        self.chat = chat
        self.created = int(time.time())
        self.plan = plan
        self.prompt_tokens = prompt_tokens
        self.k0 = k0                    # output tokens that existed before this request
        self.total = total              # output tokens when it is done (k0 included)
        self.pre_eng = self.pre_rec = None
        self.dec_eng = self.dec_rec = None
        self.dec_base = 0               # total tokens = dec_base + decode engine's count
        self.needs_decode = False       # decode here after the prefill here
        self.visible = k0               # tokens that exist now (driver-updated)
        self.sent = k0                  # tokens the client has
        self.waiter: asyncio.Future | None = None
        self.done = False
        self.cancelled = False
        self.failed: str | None = None  # the server went away
        self.stream = False
        self.continuous = False
        self.include_usage = False
        self.t_arrive = t_arrive        # engine time
        self.t_first: float | None = None
        self.kv_out: dict[str, Any] | None = None

    def count_at(self, now: float) -> int:
        """Output tokens (k0 included) that exist at engine time ``now``."""
        pr = self.pre_rec
        if pr is not None and (pr.finish_s is None or pr.finish_s > now):
            return self.k0
        d = self.dec_rec
        if d is not None:
            return self.dec_base + self.dec_eng.tokens_out(d, now)
        return self.k0 + 1 if pr is not None else self.k0

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class _Gauges:
    """The gauges and the energy counter, computed from the engines at scrape time."""

    def __init__(self, server: "EngineServer"):
        self.s = server

    def describe(self):
        return []

    def collect(self):
        s = self.s
        lab = [s.served_model]
        engines = s._all_engines()
        run = sum(ve.num_running for ve in engines)
        wait = sum(ve.num_waiting for ve in engines)
        cap = used = 0
        for ve in engines:
            for e in ve.engines:
                cap += e.kv_capacity_tokens
                used += e.kv_capacity_tokens - e.free_kv_tokens
        for name, doc, v in (
                ("vllm:num_requests_running", "Requests in the engines' batches", run),
                ("vllm:num_requests_waiting", "Requests queued in the engines", wait),
                ("vllm:gpu_cache_usage_perc", "KV-cache usage (0..1)", used / cap if cap else 0.),
                ("vllm:kv_cache_usage_perc", "KV-cache usage (0..1)", used / cap if cap else 0.)):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(lab, float(v))
            yield g
        c = CounterMetricFamily("neuscale:energy_joules", "Energy of the vPod's simulated "
                                "chips since the server started (J)", labels=["model_name"])
        c.add_metric(lab, sum(ve.energy_j() for ve in engines))
        yield c


class EngineServer:
    """The engine HTTP server of one vPod (see the module docstring)."""

    def __init__(self, *, served_model: str, arch: ModelArch, table: StepCostTable, phase: str,
                 max_batch: int, pp: int = 1, max_model_len: int = 8192,
                 max_batched_tokens: int = 8192, vpod_id: str = "sim",
                 dcn_bytes_per_s: float | None = None, host: str = "127.0.0.1"):
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', not {phase!r}")
        self.served_model = served_model
        self.arch = arch
        self.table = table
        self.phase = phase
        self.max_batch = max_batch
        self.pp = pp
        self.max_model_len = max_model_len
        self.max_batched_tokens = max_batched_tokens
        self.vpod_id = vpod_id
        self.dcn_bytes_per_s = float(dcn_bytes_per_s or 1.25e10)
        self.kv_bytes_per_token = float(table.kv_bytes_per_token)
        self.host = host
        self.port: int | None = None
        self.created = int(time.time())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._engines: dict[str, VPodEngines] = {}
        self._owner: dict[int, _Req] = {}         # engine request id -> request
        self._active: dict[int, _Req] = {}
        self._streams = 0                         # active streaming requests
        self._holds: list[float] = []             # finish times after the last advance
        self._ids = itertools.count(1)
        self._driver: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._closing = False
        self.dead = False
        self._admitted = 0                        # requests let in this loop iteration
        self._gate_q: deque[asyncio.Future] = deque()
        self._gate_on = False
        self._init_metrics()

    # ---- life cycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def now(self) -> float:
        """Engine time: seconds since the server started."""
        return self._loop.time() - self._t0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, port: int = 0) -> int:
        """Listen on ``host:port`` (0: a free port) and start the driver; returns the port."""
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._engines[self.phase] = self._build(self.phase)
        self._runner = web.AppRunner(self.app(), handle_signals=False, access_log=None,
                                     handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, port, backlog=4096,
                                 reuse_address=True)
        await self._site.start()
        self.port = self._runner.addresses[0][1]
        self._driver = asyncio.create_task(self._drive(), name=f"engine-driver-{self.vpod_id}")
        return self.port

    async def stop(self) -> None:
        """Stop serving: open requests end (streams are closed, waiting calls answer 503),
        the port is closed."""
        if self._closing:
            return
        self._closing = True
        for r in list(self._active.values()):
            r.failed = "the engine server is shutting down"
            r.wake()
        if self._driver is not None:
            self._driver.cancel()
            await asyncio.gather(self._driver, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    def kill(self) -> None:
        """Die at once, as a crashed VM: every connection is reset, the port closes."""
        self.dead = True
        self._closing = True
        if self._driver is not None:
            self._driver.cancel()
        runner = self._runner
        if runner is not None and runner.server is not None:
            for h in list(runner.server.connections):
                t = h.transport
                if t is not None:
                    t.abort()
        for r in list(self._active.values()):
            r.failed = "killed"
            r.wake()
        self._active.clear()
        if runner is not None:
            for srv in [getattr(s, "_server", None) for s in runner.sites]:
                if srv is not None:
                    srv.close()          # stop accepting at once; cleanup finishes the rest
            self._loop.create_task(runner.cleanup())

    # ---- engines ------------------------------------------------------------------------------
    def _build(self, phase: str) -> VPodEngines:
        return vpod_engines(self.table, phase, self.max_batch, self.pp, self.max_batched_tokens,
                            self.now())

    def _engines_for(self, phase: str) -> VPodEngines:
        ve = self._engines.get(phase)
        if ve is None:
            ve = self._engines[phase] = self._build(phase)
            if self._engines.get("prefill") is not None and \
                    self._engines.get("decode") is not None:
                # driver order: prefill first (its finishes feed decode)
                self._engines = {"prefill": self._engines["prefill"],
                                 "decode": self._engines["decode"]}
        return ve

    def _all_engines(self) -> list[VPodEngines]:
        return list(self._engines.values())

    def _submit(self, phase: str, r: _Req, arrival_s: float, prompt: int, output: int):
        """Submit to the phase's engines; returns (engine, record) (the engine that
        :meth:`VPodEngines.choose` picks at the arrival: the one that can start it first)."""
        ve = self._engines_for(phase)
        k = ve.choose(prompt, output, arrival_s)
        eid = next(self._ids)
        rec = ve.submit_to(k, eid, arrival_s, prompt, output)
        self._owner[eid] = r
        return ve.engines[k], rec

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens one (virtual) engine holds: whole blocks of its share of the cache, as the
        engines count them."""
        ve = next(iter(self._engines.values()), None)
        if ve is not None:
            return ve.engines[0].kv_capacity_tokens
        cap = self.table.kv_capacity_tokens // self.pp
        return cap // _BLOCK_TOKENS * _BLOCK_TOKENS

    def _check_fits(self, phase: str, prompt: int, output: int) -> None:
        """A request the engines would refuse (longer than the KV cache) is a 400."""
        cap = self.kv_capacity_tokens
        need = prompt if phase == "prefill" else prompt + output - 1
        if need > cap:
            raise BadRequest(400, f"the request needs {need} KV-cache tokens, more than this "
                                  f"vPod's {cap}", param="max_tokens")

    # ---- the driver ---------------------------------------------------------------------------
    def _kick(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    async def _drive(self) -> None:
        loop = self._loop
        try:
            while True:
                now = self.now()
                self._advance(now)
                woken = self._deliver(now)
                # wake the handlers a batch per loop iteration: requests that arrive meanwhile
                # (a /health probe) wait for one batch, not for every stream's chunk
                for i in range(0, len(woken), WAKE_BATCH):
                    if i:
                        await asyncio.sleep(0)
                    for r in woken[i:i + WAKE_BATCH]:
                        r.wake()
                t = self._next_wake(now)
                self._wake = loop.create_future()
                if t is None:
                    await self._wake
                    continue
                delay = max(t - self.now(), 0.0005)
                h = loop.call_later(delay, self._kick)
                try:
                    await self._wake
                finally:
                    h.cancel()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug here must not hang every client silently
            log.exception("engine driver of %s failed", self.vpod_id)
            self._closing = True                 # new requests get 503 from here on
            for r in list(self._active.values()):
                r.failed = "internal error in the simulated engine"
                r.wake()
            raise

    def _advance(self, now: float) -> None:
        owner = self._owner
        holds = self._holds
        for phase, ve in list(self._engines.items()):
            for rec in ve.advance_to(now):
                r = owner.pop(rec.req_id, None)
                if rec.finish_s > now:
                    heapq.heappush(holds, rec.finish_s)
                if r is None or r.cancelled:
                    continue
                if phase == "prefill":
                    self._metrics_first_token(r, rec.finish_s)
                    if r.needs_decode:
                        # the prompt KV (and k0 + 1 tokens) exist here from its finish on
                        p = r.prompt_tokens + r.k0
                        r.dec_base = r.k0
                        r.dec_eng, r.dec_rec = self._submit("decode", r, rec.finish_s, p,
                                                            r.total - r.k0)
        while holds and holds[0] <= now:
            heapq.heappop(holds)

    def _deliver(self, now: float) -> list[_Req]:
        """Update every open request's token count; returns those whose handler has work
        (a stream with new tokens, a finished request)."""
        done = []
        woken = []
        for key, r in self._active.items():
            v = r.count_at(now)
            if v != r.visible:
                if r.t_first is None and v > r.k0:
                    r.t_first = now
                r.visible = v
                if v >= r.total:
                    r.done = True
                    done.append(key)
                    woken.append(r)
                elif r.stream:
                    woken.append(r)
        for key in done:
            r = self._active.pop(key)
            if r.stream:
                self._streams -= 1
            self._metrics_done(r, now)
        return woken

    def _next_wake(self, now: float) -> float | None:
        t = math.inf
        for ve in self._engines.values():
            e = ve.next_event_time()
            if e is not None and e < t:
                t = e
        if self._holds and self._holds[0] < t:
            t = self._holds[0]
        if self._streams:
            f = min(1.0, self._streams / TICK_STREAMS)
            t = min(t, now + TICK_MIN_S + (TICK_MAX_S - TICK_MIN_S) * f)
        return None if t == math.inf else t

    # ---- metrics ------------------------------------------------------------------------------
    def _init_metrics(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        lab = ["model_name"]
        lat = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
        self.m_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                                lab, buckets=lat, registry=r).labels(self.served_model)
        self.m_tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token",
                                lab, buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                                              0.4, 0.5, 0.75, 1.0, 2.5), registry=r
                                ).labels(self.served_model)
        self.m_e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency", lab,
                               buckets=(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                                        20.0, 30.0, 40.0, 50.0, 60.0), registry=r
                               ).labels(self.served_model)
        self.m_prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed", lab,
                                registry=r).labels(self.served_model)
        self.m_gen = Counter("vllm:generation_tokens", "Generation tokens processed", lab,
                             registry=r).labels(self.served_model)
        self.m_success = Counter("vllm:request_success", "Finished requests", lab +
                                 ["finished_reason"], registry=r)
        r.register(_Gauges(self))

    def _metrics_first_token(self, r: _Req, t: float) -> None:
        self.m_ttft.observe(max(0.0, t - r.t_arrive))

    def _metrics_done(self, r: _Req, now: float) -> None:
        if r.pre_rec is not None:
            self.m_prompt.inc(r.prompt_tokens + r.k0)
        elif r.t_first is not None and r.total > r.k0:
            self.m_ttft.observe(max(0.0, r.t_first - r.t_arrive))
        new = r.total - r.k0
        self.m_gen.inc(new)
        d = r.dec_rec
        if d is not None and d.finish_s is not None and d.output_tokens > 1:
            self.m_tpot.observe((d.finish_s - d.first_token_s) / (d.output_tokens - 1))
        self.m_e2e.observe(max(0.0, now - r.t_arrive))
        self.m_success.labels(self.served_model, r.plan.finish_reason).inc()

    # ---- HTTP handlers ------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.served_model, "object": "model", "created": self.created,
            "owned_by": "neuscale-sim", "root": self.served_model, "parent": None,
            "max_model_len": self.max_model_len}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    def _parse(self, body: Any, chat: bool) -> _Parsed:
        if not isinstance(body, dict):
            raise BadRequest(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.served_model:
            raise BadRequest(404, f"The model `{model}` does not exist.", param="model",
                             code="model_not_found", type="NotFoundError")
        p = _Parsed()
        p.chat = chat
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
                raise BadRequest(400, "'messages' must be a non-empty array of objects with a "
                                      "'role'", param="messages")
            for m in msgs:
                c = m.get("content")
                if c is not None and not isinstance(c, (str, list)):
                    raise BadRequest(400, "a message's 'content' must be a string or an array",
                                     param="messages")
            p.prompt = chat_prompt(msgs)
            mt = _opt_int(body, "max_completion_tokens", 1)
            max_tokens = mt if mt is not None else _opt_int(body, "max_tokens", 1)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise BadRequest(400, "'prompt' must be a string (one prompt per request)",
                                 param="prompt")
            p.prompt = prompt
            max_tokens = _opt_int(body, "max_tokens", 1)
            if max_tokens is None:
                max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
        n = _opt_int(body, "n", 1)
        if n is not None and n != 1:
            raise BadRequest(400, "n must be 1 on this server", param="n")
        for key in ("temperature", "top_p"):
            v = body.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise BadRequest(400, f"'{key}' must be a number", param=key)
        p.prompt_tokens = count_tokens(p.prompt)
        if p.prompt_tokens < 1:
            raise BadRequest(400, "the prompt must not be empty", param="prompt")
        lim, P = self.max_model_len, p.prompt_tokens
        param = "messages" if chat else "prompt"
        if max_tokens is None:                       # chat default: the rest of the context
            if P >= lim:
                raise BadRequest(400, f"This model's maximum context length is {lim} tokens. "
                                      f"However, your {param} resulted in {P} tokens. Please "
                                      f"reduce the length of the {param}.", param=param,
                                 code="context_length_exceeded")
            max_tokens = lim - P
        elif P + max_tokens > lim:
            raise BadRequest(400, f"This model's maximum context length is {lim} tokens. "
                                  f"However, you requested {P + max_tokens} tokens ({P} in the "
                                  f"{param}, {max_tokens} in the completion). Please reduce "
                                  f"the length of the {param} or completion.", param=param,
                             code="context_length_exceeded")
        p.max_tokens = max_tokens
        p.min_tokens = _opt_int(body, "min_tokens", 0) or 0
        if p.min_tokens > max_tokens:
            raise BadRequest(400, f"min_tokens ({p.min_tokens}) must be less than or equal to "
                                  f"max_tokens ({max_tokens})", param="min_tokens")
        p.ignore_eos = _opt_bool(body, "ignore_eos")
        stop = body.get("stop")
        if stop is None:
            p.stop = []
        elif isinstance(stop, str):
            p.stop = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            p.stop = list(stop)
        else:
            raise BadRequest(400, "'stop' must be a string or an array of strings",
                             param="stop")
        seed = body.get("seed")
        if seed is not None and not _is_int(seed):
            raise BadRequest(400, "'seed' must be an integer", param="seed")
        p.seed = seed
        p.stream = _opt_bool(body, "stream")
        so = body.get("stream_options")
        if so is not None:
            if not isinstance(so, dict):
                raise BadRequest(400, "'stream_options' must be an object",
                                 param="stream_options")
            if not p.stream:
                raise BadRequest(400, "Stream options can only be defined when `stream=True`.",
                                 param="stream_options")
        so = so or {}
        p.include_usage = _opt_bool(so, "include_usage")
        p.continuous = _opt_bool(so, "continuous_usage_stats")
        kv = body.get("kv_transfer_params")
        if kv is not None and not isinstance(kv, dict):
            raise BadRequest(400, "'kv_transfer_params' must be an object",
                             param="kv_transfer_params")
        p.kv = kv or {}
        return p

    def _schedule(self, p: _Parsed) -> _Req:
        """Plan the output and put the request into the engines (see the module docstring)."""
        kv = p.kv
        prefill_only = kv.get("do_remote_decode") is True
        remote = kv.get("do_remote_prefill") is True
        k = kv.get("generated_tokens", 1 if remote else 0)
        if not _is_int(k) or k < 0:
            raise BadRequest(400, "kv_transfer_params.generated_tokens must be an integer >= 0",
                             param="kv_transfer_params")
        if remote:
            k = max(k, 1)
        if prefill_only:
            k = 0
        plan = plan_output(p.prompt, max_tokens=1 if prefill_only else p.max_tokens,
                           min_tokens=p.min_tokens, ignore_eos=p.ignore_eos, stop=p.stop,
                           seed=p.seed)
        P, T = p.prompt_tokens, plan.total
        now = self.now()
        r = _Req(uuid.uuid4().hex, p.chat, plan, P, min(k, T), max(T, k), now)
        r.stream, r.continuous, r.include_usage = p.stream, p.continuous, p.include_usage
        if k >= T:                                      # nothing left to make
            r.done = True
            return r
        if remote:
            kv_tokens = P + k - 1
            src = kv.get("dcn_bytes_per_s")
            bw = self.dcn_bytes_per_s
            if isinstance(src, (int, float)) and not isinstance(src, bool) and src > 0:
                bw = min(bw, float(src))
            self._check_fits("decode", kv_tokens, T - k + 1)
            arrive = now + kv_transfer_s(kv_tokens, self.kv_bytes_per_token, bw)
            r.dec_base = k - 1
            r.dec_eng, r.dec_rec = self._submit("decode", r, arrive, kv_tokens, T - k + 1)
        else:
            ptok = P + k                                # recompute lost output tokens too
            self._check_fits("prefill", ptok, 1)
            if T > k + 1:
                self._check_fits("decode", ptok, T - k)
            r.needs_decode = T > k + 1
            r.pre_eng, r.pre_rec = self._submit("prefill", r, now, ptok, 1)
            if prefill_only:
                r.kv_out = {"do_remote_prefill": True, "do_remote_decode": False,
                            "remote_engine_id": self.vpod_id, "remote_host": self.host,
                            "remote_port": self.port, "kv_tokens": P,
                            "kv_bytes": int(P * self.kv_bytes_per_token),
                            "dcn_bytes_per_s": self.dcn_bytes_per_s}
        return r

    # -- admission: a burst of arrivals is taken in ADMIT_BATCH per loop iteration
    def _gate(self) -> asyncio.Future | None:
        """None: go ahead; else a future to await (set when this request's turn comes)."""
        if not self._gate_q and self._admitted < ADMIT_BATCH:
            self._admitted += 1
            if not self._gate_on:
                self._gate_on = True
                self._loop.call_soon(self._gate_tick)
            return None
        f = self._loop.create_future()
        self._gate_q.append(f)
        if not self._gate_on:
            self._gate_on = True
            self._loop.call_soon(self._gate_tick)
        return f

    def _gate_tick(self) -> None:
        """Once per loop iteration while arrivals are queued: let the next batch in."""
        n = 0
        q = self._gate_q
        while q and n < ADMIT_BATCH:
            f = q.popleft()
            if not f.done():
                f.set_result(None)
                n += 1
        self._admitted = n
        if n or q:
            self._loop.call_soon(self._gate_tick)
        else:
            self._gate_on = False

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        g = self._gate()
        if g is not None:
            await g
        if self._closing:
            return BadRequest(503, "the engine is shutting down", type="ServiceUnavailable"
                              ).response()
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            return BadRequest(400, "the request body is not valid JSON").response()
        try:
            p = self._parse(body, chat)
            r = self._schedule(p)
        except BadRequest as e:
            return e.response()
        except ValueError as e:                          # the engine refused it
            return BadRequest(400, str(e)).response()
        if not r.done:
            self._active[id(r)] = r
            if r.stream:
                self._streams += 1
            self._kick()
        try:
            if r.stream:
                return await self._respond_stream(request, r)
            return await self._respond_whole(r)
        except asyncio.CancelledError:           # the client went away (aiohttp cancels us)
            self._cancel(r)
            raise
        finally:
            if not r.done and not r.cancelled and self._active.pop(id(r), None) is not None:
                if r.stream:
                    self._streams -= 1

    def _cancel(self, r: _Req) -> None:
        """The client went away: stop delivering and abort the request in the engines, as
        vLLM does (its batch slot and KV blocks are free at once)."""
        if r.done or r.cancelled:
            return
        r.cancelled = True
        if self._active.pop(id(r), None) is not None and r.stream:
            self._streams -= 1
        if not self._closing:
            # the engines first run what happened before now, so that the abort happens now
            # (the driver may be asleep until the end of a long run of decode steps)
            self._advance(self.now())
            for phase, rec in (("prefill", r.pre_rec), ("decode", r.dec_rec)):
                if rec is not None:
                    self._owner.pop(rec.req_id, None)
                    if rec.finish_s is None:
                        self._engines[phase].abort(rec)
            self._kick()                         # the driver plans its next wake-up again
        if not self.dead:
            self.m_success.labels(self.served_model, "abort").inc()

    async def _wait(self, r: _Req) -> None:
        r.waiter = self._loop.create_future()
        await r.waiter
        r.waiter = None

    # -- whole answers
    async def _respond_whole(self, r: _Req) -> web.StreamResponse:
        while not r.done and r.failed is None:
            await self._wait(r)
        if r.failed is not None:
            return BadRequest(503, r.failed, type="ServiceUnavailable").response()
        text = r.plan.text(r.k0, r.total)
        fr = r.plan.finish_reason
        usage = {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.total,
                 "total_tokens": r.prompt_tokens + r.total}
        if r.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                              "tool_calls": []},
                      "logprobs": None, "finish_reason": fr, "stop_reason": r.plan.stop_reason}
            obj, rid = "chat.completion", "chatcmpl-" + r.id
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fr,
                      "stop_reason": r.plan.stop_reason}
            obj, rid = "text_completion", "cmpl-" + r.id
        out = {"id": rid, "object": obj, "created": r.created, "model": self.served_model,
               "choices": [choice], "usage": usage}
        if r.kv_out is not None:
            out["kv_transfer_params"] = r.kv_out
        return web.Response(body=_dumps(out).encode(), content_type="application/json")

    # -- streams
    async def _respond_stream(self, request: web.Request, r: _Req) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        try:
            await self._write_stream(request, resp, r)
        except ConnectionError:
            # the client went away while we wrote (a disconnect, a gateway migrating the
            # stream): normal. Abort the request; aiohttp closes the connection quietly when
            # it finds it broken (an exception here would be logged with a traceback).
            log.debug("%s: client of request %s went away", self.vpod_id, r.id)
            self._cancel(r)
        return resp

    async def _write_stream(self, request: web.Request, resp: web.StreamResponse,
                            r: _Req) -> None:
        await resp.prepare(request)
        model = _dumps(self.served_model)
        if r.chat:
            head = (f'data: {{"id":"chatcmpl-{r.id}","object":"chat.completion.chunk",'
                    f'"created":{r.created},"model":{model},"choices":[')
        else:
            head = (f'data: {{"id":"cmpl-{r.id}","object":"text_completion",'
                    f'"created":{r.created},"model":{model},"choices":[')
        P = r.prompt_tokens

        def usage(n: int) -> str:
            return (f'{{"prompt_tokens":{P},"completion_tokens":{n},'
                    f'"total_tokens":{P + n}}}')

        if r.chat:
            u = f',"usage":{usage(r.sent)}' if r.continuous else ""
            await resp.write(f'{head}{{"index":0,"delta":{{"role":"assistant","content":""}},'
                             f'"logprobs":null,"finish_reason":null}}]{u}}}\n\n'.encode())
        plan = r.plan
        while True:
            if r.failed is not None:
                # the server goes away: end the stream without [DONE] (a broken stream)
                return
            v = r.visible
            if v > r.sent or r.done:
                text = plan.text(r.sent, v)
                final = r.done
                if text or final or r.continuous:
                    if final:
                        tail = (f'"finish_reason":"{plan.finish_reason}","stop_reason":'
                                f'{_dumps(plan.stop_reason)}')
                    else:
                        tail = '"finish_reason":null'
                    if r.chat:
                        delta = f'{{"content":{_dumps(text)}}}' if text or not final else "{}"
                        choice = f'{{"index":0,"delta":{delta},"logprobs":null,{tail}}}'
                    else:
                        choice = f'{{"index":0,"text":{_dumps(text)},"logprobs":null,{tail}}}'
                    extra = f',"usage":{usage(v)}' if r.continuous else ""
                    if final and r.kv_out is not None:
                        extra += f',"kv_transfer_params":{_dumps(r.kv_out)}'
                    await resp.write(f"{head}{choice}]{extra}}}\n\n".encode())
                r.sent = v
                if final:
                    break
                continue
            await self._wait(r)
        if r.include_usage:
            await resp.write(f'{head}],"usage":{usage(r.total)}}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


# ---- construction and the stand-alone command ------------------------------------------------

def step_cost_table(arch: ModelArch, catalog: Catalog, chip: str, topology: str, tp: int,
                    pp: int = 1, ep: int = 1, stack=None, attn: str = "dp") -> StepCostTable:
    """The allocation's step-cost table under the serving-stack profile ``stack`` (a name, a
    JSON profile or a :class:`dse.stacks.StackProfile`; default ``vllm-tpu``) and the MoE
    layout ``attn`` (:class:`dse.parallel.Parallelism`), cached on disk under the
    ``stepcost`` cache."""
    from dse.cache import cache_path
    from dse.stacks import parse_stack
    from sim.chip import ChipModel
    cm = ChipModel.of(arch, catalog, chip, topology, tp, pp, ep, stack=parse_stack(stack),
                      attn=attn)
    return StepCostTable(cm, cache_dir=cache_path("stepcost"))


def raise_fd_limit() -> None:
    """Lift the soft open-files limit to the hard one (1000 streams need 1000 sockets)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY
                                                        else max(soft, 65536), hard))
    except (ImportError, ValueError, OSError):
        pass


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m backends.sim.engine_server",
                                 description="One simulated vLLM engine server (a vPod's "
                                             "engines on the chip model, in real time).")
    env = os.environ
    ap.add_argument("--model", default="llama3-8b", help="preset or config.json path")
    ap.add_argument("--served-model-name", default=None)
    # chip, topology and phase default to what a remote backend puts in the engine's
    # environment (backends.engine.engine_env), so the same vLLM command line starts this
    # stand-in on an SSH host (engine.command: [python3, -m, backends.sim.engine_server,
    # --model])
    ap.add_argument("--chip", default=env.get("NEUSCALE_CHIP", "v6e"))
    ap.add_argument("--topology", default=env.get("NEUSCALE_TOPOLOGY", "1x1"))
    ap.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    ap.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--data-parallel-size", dest="dp", type=int, default=None,
                    help="vLLM's flag for an expert-parallel vPod: ep = this, and "
                         "--max-num-seqs is per rank")
    ap.add_argument("--phase", choices=("prefill", "decode"),
                    default=env.get("NEUSCALE_PHASE", "decode"))
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--host", default="127.0.0.1", help="listen address")
    ap.add_argument("--stack", default=env.get("NEUSCALE_STACK"),
                    help="serving-stack profile the engine runs: a name (vllm-tpu, sglang-jax, "
                         "jetstream, none) or a JSON profile (default vllm-tpu)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--url-file", default=None, help="write the URL here once listening")
    # vLLM flags a remote backend passes that mean nothing here
    for flag in ("--download-dir", "--dtype", "--distributed-executor-backend"):
        ap.add_argument(flag, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--enable-expert-parallel", action="store_true", help=argparse.SUPPRESS)
    return ap


def vllm_layout(arch: ModelArch, tp: int, ep: int, dp: int | None,
                enable_expert_parallel: bool) -> tuple[int, int, str, int]:
    """What vLLM runs for these flags, as the DSE names it: ``(tp, ep, attn, ranks)``, where
    ``ranks`` is the number of data-parallel engines ``--max-num-seqs`` applies to each
    (:func:`backends.engine.vllm_argv` is the other direction)."""
    if dp:
        if arch.is_moe and dp > 1 and not enable_expert_parallel:
            # vLLM then makes the experts one TP group over all DP x TP ranks: no layout here
            raise NeuScaleError("--data-parallel-size without --enable-expert-parallel (the "
                                "experts tensor-parallel over every rank) is not a modelled "
                                "layout; add --enable-expert-parallel")
        # DP attention ranks of TP tp, experts expert-parallel over all of them: "hybrid"
        # (with tp = 1 that is the "dp" layout's split)
        return tp, dp, ("hybrid" if arch.is_moe and tp > 1 and dp > 1 else "dp"), dp
    if enable_expert_parallel and arch.is_moe and ep == 1 and tp > 1:
        # TP + EP without data parallelism: attention TP over the ranks, whole experts
        # expert-parallel over the same ranks ("tp")
        return 1, tp, "tp", 1
    return tp, ep, "dp", 1


async def _main_async(args: argparse.Namespace) -> None:
    from dse.files import write_atomic
    catalog = default_catalog()
    arch = load_model(args.model)
    args.tp, args.ep, attn, per_rank = vllm_layout(arch, args.tp, args.ep, args.dp,
                                                   args.enable_expert_parallel)
    args.max_num_seqs *= per_rank
    table = step_cost_table(arch, catalog, args.chip, args.topology, args.tp, args.pp, args.ep,
                            args.stack, attn)
    chip = catalog.get(args.chip)
    srv = EngineServer(served_model=args.served_model_name or args.model, arch=arch,
                       table=table, phase=args.phase, max_batch=args.max_num_seqs, pp=args.pp,
                       max_model_len=args.max_model_len or arch.max_context or 8192,
                       max_batched_tokens=args.max_num_batched_tokens,
                       dcn_bytes_per_s=chip.dcn_bw_bytes_per_s * table.num_chips,
                       host=args.host)
    await srv.start(args.port)
    gc.freeze()                 # start-up objects out of the collector's way (shorter pauses)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.url_file:
        write_atomic(Path(args.url_file), srv.url + "\n")
    print(srv.url, flush=True)
    await stop.wait()
    await srv.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    raise_fd_limit()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        asyncio.run(_main_async(args))
    except ValueError as e:          # NeuScaleError and friends: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
