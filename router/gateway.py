"""The OpenAI-compatible gateway (paper §3.4 request routing; design §4).

An aiohttp app that serves ``/v1/completions``, ``/v1/chat/completions`` (streaming and not),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus) and ``/admin/status`` in front of the
vPods' engines (vLLM's OpenAI HTTP surface). It knows the engines only as URLs: the controller
hands it routing tables and endpoints through :meth:`Gateway.set_targets` (an atomic swap).

One request:

1. validate (OpenAI error format), count the prompt's tokens (:mod:`dse.tokens`, or a real
   tokenizer), refuse one longer than the model's context or the DB's largest bucket (400
   ``context_length_exceeded``), predict the output length (:mod:`router.predict`);
2. **prefill** (when a ``"prefill"`` table is set: P/D disaggregation) on the least-loaded vPod
   of the prefill group of its input length, with ``max_tokens: 1`` and
   ``kv_transfer_params {"do_remote_decode": true}``; the first token goes to the client at once;
3. **decode** on the least-loaded vPod of the decode group of input + predicted output, with the
   original request, the prefill's ``kv_transfer_params`` and ``generated_tokens``. Upstream is
   always streamed (also for a non-streaming client, whose response is assembled) with
   ``continuous_usage_stats``, so the gateway knows the output length after every chunk;
4. whenever the length crosses a bucket boundary the output is re-predicted and
   :func:`router.routing.should_migrate` decides; on a migration the stream is closed on the
   current vPod and continued on a vPod of the target group with ``generated_tokens`` = tokens
   so far and ``kv_transfer_params`` naming the current vPod as the KV source (stop-and-copy:
   the destination charges the KV transfer before it produces; the simulator models the same);
5. a vPod that fails (connection refused or reset, 5xx, read timeout, truncated stream) is
   quarantined for ``quarantine_s`` and the request continues the same way on another vPod of
   the group, else of the longer groups (when the failed vPod had produced tokens its KV is
   lost: the new vPod recomputes it, ``kv_transfer_params`` carries only ``generated_tokens``);
   only when no vPod is left does the client get an error (mid-stream: an ``error`` event);
6. the client sees one stream under the gateway's id: text chunks as they arrive, the final
   ``finish_reason``, the usage the engines counted (``usage`` in chunks only when the client
   asked for ``continuous_usage_stats``; a usage chunk when it asked for ``include_usage``);
7. a client that disconnects cancels the upstream request (the upstream connection is closed;
   noticed on the next upstream chunk, or at once when the app runs with
   ``handler_cancellation=True`` as :meth:`Gateway.start` does).

No vPod in the group: the request waits up to ``wait_for_vpod_s`` when the controller said the
group has vPods starting (``starting`` of :meth:`set_targets`), else (or then) 503 with
``Retry-After``. All of it runs on one asyncio loop; call :meth:`set_targets`,
:meth:`take_samples` and :meth:`outstanding` from that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import json
import logging
import math
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Callable, Collection, Hashable, Mapping, Sequence
from urllib.parse import urlsplit

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest

from dse.buckets import SEQ_BUCKETS
from dse.tokens import TokenCounter, count_tokens

from .openai_api import (CHAT, COMPLETIONS, DEFAULT_COMPLETION_MAX_TOKENS, PATHS, APIError,
                         Formatter, ParsedRequest, context_length_exceeded, model_not_found,
                         internal_error, models_response, no_vpod, parse_request, unauthorized,
                         upstream_error, usage_json)
from .predict import LengthPredictor, MedianPredictor
from .routing import (RoutingTable, crossed_bucket, free_slot_first, least_loaded, ready_group,
                      should_migrate)
from .upstream import EngineClient, UpstreamFailure, UpstreamRejected

log = logging.getLogger("neuscale.gateway")

PHASES = ("prefill", "decode")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}
_now = time.monotonic
_perf = time.perf_counter


@dataclass(frozen=True)
class Endpoint:
    """A READY vPod the gateway may send requests to."""

    vpod_id: str
    url: str                             # "http://127.0.0.1:PORT" (no trailing slash needed)
    throughput_tok_per_s: float = 1000.0  # its tokens/s (prefill: input, decode: output)
    max_batch: int = 256


@dataclass(frozen=True)
class Samples:
    """What the gateway saw since the previous :meth:`Gateway.take_samples`.

    ``tokens[phase][b]``: tokens of bucket ``b`` (of the gateway's ``edges``) of the requests
    admitted (served or not: demand): prefill, input tokens by input length; decode, predicted
    output tokens (of requests predicted to decode more than the first token) by input +
    predicted output length.
    ``waiting[(phase, group)]``: the peak number of requests that waited at the gateway for a
    vPod of the group (a request refused with 503 counts 1). ``interval_s``: wall time covered.
    """

    interval_s: float
    tokens: dict[str, np.ndarray]
    waiting: dict[tuple[str, Hashable], int]
    requests: int = 0                    # requests admitted
    # (phase, group) -> the longest a finished request stayed on a vPod of the group (decode:
    # from its first token to its last): how long the group's vPods take to drain
    longest_s: dict[tuple[str, Hashable], float] = field(default_factory=dict)
    # (phase, bucket its tokens were counted at) -> [seconds, requests] of the stays on a
    # vPod: prefill, the prefill call (input bucket); decode, first to last token (input +
    # predicted output bucket). How long a request holds a vPod's server or slot.
    stay_s: dict[tuple[str, int], list] = field(default_factory=dict)


@dataclass(frozen=True)
class _Targets:
    tables: Mapping[str, RoutingTable]
    endpoints: Mapping[tuple[str, Hashable], tuple[Endpoint, ...]]
    starting: frozenset


class _SSEResponse(web.StreamResponse):
    """A stream whose headers leave with its first chunk (one send instead of two; aiohttp's
    own ``Response`` does the same)."""

    _send_headers_immediately = False


class ClientGone(Exception):
    """The client disconnected."""


class _Load:
    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0.0


class _Flight:
    """One request in flight."""

    __slots__ = ("req", "path", "prompt_tokens", "max_tokens", "min_tokens", "est", "generated",
                 "engine_prompt", "group", "kv", "base", "t0", "t_first", "finish", "opened",
                 "migrations", "failovers", "est0", "group0", "text_mode", "text_out",
                 "gen_base")

    def __init__(self, req: ParsedRequest, prompt_tokens: int, max_tokens: int, est: int,
                 t0: float, text_mode: bool = False):
        self.req = req
        self.path = PATHS[req.kind]
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.min_tokens = min(req.min_tokens, max_tokens)
        self.est = est
        self.est0 = est                           # the prediction that chose the first group
        self.group0: Hashable | None = None      # the decode group that prediction chose
        self.generated = 0
        self.engine_prompt: int | None = None
        self.group: Hashable | None = None
        self.kv: dict[str, Any] | None = None     # where the request's KV lives (None: nowhere)
        # the request's fields as JSON without the closing brace: per-call fields are appended
        self.base = json.dumps(req.upstream, separators=(",", ":"))[:-1]
        self.t0 = t0
        self.t_first: float | None = None
        self.finish: str | None = None
        self.opened = False
        self.migrations = 0
        self.failovers = 0
        # continuation "text" (engines that cannot take KV from another engine, e.g. vLLM
        # without a KV connector): a call after the first gets the text so far appended to
        # the prompt (chat: a final assistant message to continue) and the rest of the budget
        self.text_mode = text_mode
        self.text_out: list[str] = []
        self.gen_base = 0                         # output tokens before the current call

    def body(self, *, stream: bool, max_tokens: int, kv: dict[str, Any] | None) -> bytes:
        base = self.base
        self.gen_base = 0
        if self.text_mode:
            kv = None
            if self.generated:
                self.gen_base = self.generated
                up = dict(self.req.upstream)
                so_far = "".join(self.text_out)
                if "messages" in up:
                    up["messages"] = [*up["messages"], {"role": "assistant",
                                                        "content": so_far}]
                    up["continue_final_message"] = True
                    up["add_generation_prompt"] = False
                else:
                    up["prompt"] = str(up.get("prompt", "")) + so_far
                base = json.dumps(up, separators=(",", ":"))[:-1]
                max_tokens = max(1, max_tokens - self.generated)
        mt = min(max(self.min_tokens - self.gen_base, 0), max_tokens)
        parts = [base, f',"max_tokens":{max_tokens}']
        if mt:
            parts.append(f',"min_tokens":{mt}')
        if stream:
            parts.append(',"stream":true,"stream_options":{"include_usage":true,'
                         '"continuous_usage_stats":true}')
        else:
            parts.append(',"stream":false')
        if kv is not None:
            parts.append(',"kv_transfer_params":' + json.dumps(kv, separators=(",", ":")))
        parts.append("}")
        return "".join(parts).encode()

    def decode_kv(self) -> dict[str, Any] | None:
        """``kv_transfer_params`` of a decode call: where the KV is, and how many output tokens
        already exist."""
        if self.kv is None and not self.generated:
            return None
        kv = dict(self.kv or {})
        kv["generated_tokens"] = self.generated
        return kv

    @property
    def usage_prompt(self) -> int:
        return self.engine_prompt if self.engine_prompt is not None else self.prompt_tokens


class GatewayMetrics:
    """The gateway's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        lat = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.requests = Counter("neuscale_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("neuscale_ttft_seconds", "Time to first token at the gateway",
                              buckets=lat, registry=r)
        self.tpot = Histogram("neuscale_tpot_seconds", "Time per output token after the first",
                              buckets=(.001, .0025, .005, .01, .02, .04, .06, .08, .1, .15, .2,
                                       .3, .5, 1, 2.5), registry=r)
        self.e2e = Histogram("neuscale_e2e_seconds", "Request latency, arrival to last token",
                             buckets=lat, registry=r)
        self.routed = Counter("neuscale_routed", "Upstream calls routed, by phase and group",
                              ["phase", "group"], registry=r)
        self.migrations = Counter("neuscale_migrations", "Requests moved to a longer group at a "
                                  "bucket boundary (§3.4)", registry=r)
        self.failovers = Counter("neuscale_failovers", "Requests continued on another vPod after "
                                 "a vPod failed", registry=r)
        self.errors = Counter("neuscale_errors", "Errors by kind", ["kind"], registry=r)
        self.fallbacks = Counter("neuscale_predictor_fallbacks", "Predictions the configured "
                                 "predictor failed to give (the default answered)", registry=r)
        self.predictor = Gauge("neuscale_predictor_active", "The output-length predictor "
                               "answering (1) and the one configured", ["predictor", "configured"],
                               registry=r)
        pl = ["group"]
        self.pred_requests = Counter("neuscale_prediction_requests", "Requests that ended on "
                                     "their own, by the decode group their first prediction chose",
                                     pl, registry=r)
        self.pred_tokens = Counter("neuscale_predicted_output_tokens", "First predicted output "
                                   "tokens of those requests", pl, registry=r)
        self.actual_tokens = Counter("neuscale_actual_output_tokens", "Actual output tokens of "
                                     "those requests", pl, registry=r)
        self.abs_error = Counter("neuscale_prediction_abs_error_tokens", "Sum of |predicted - "
                                 "actual| output tokens of those requests", pl, registry=r)
        self.bucket_hits = Counter("neuscale_prediction_bucket_hits", "Those requests whose "
                                   "predicted output fell in the bucket of the actual output",
                                   pl, registry=r)
        self._pred: dict[str, tuple] = {}
        self.in_flight = Gauge("neuscale_requests_in_flight", "Requests being served",
                               registry=r)
        self.waiting = Gauge("neuscale_requests_waiting", "Requests waiting for a vPod",
                             ["phase", "group"], registry=r)
        self._routed: dict[tuple[str, Hashable], Any] = {}
        self._req: dict[tuple[str, int], Any] = {}
        self._err: dict[str, Any] = {}

    def routed_to(self, phase: str, group: Hashable) -> None:
        c = self._routed.get((phase, group))
        if c is None:
            c = self._routed[(phase, group)] = self.routed.labels(phase, str(group))
        c.inc()

    def answered(self, endpoint: str, status: int) -> None:
        c = self._req.get((endpoint, status))
        if c is None:
            c = self._req[(endpoint, status)] = self.requests.labels(endpoint, str(status))
        c.inc()

    def prediction(self, group: Hashable, predicted: int, actual: int, hit: bool) -> None:
        """Predicted against actual output length of a request that ended on its own."""
        key = str(group)
        c = self._pred.get(key)
        if c is None:
            c = self._pred[key] = (self.pred_requests.labels(key), self.pred_tokens.labels(key),
                                   self.actual_tokens.labels(key), self.abs_error.labels(key),
                                   self.bucket_hits.labels(key))
        c[0].inc()
        c[1].inc(predicted)
        c[2].inc(actual)
        c[3].inc(abs(predicted - actual))
        if hit:
            c[4].inc()

    def error(self, kind: str) -> None:
        c = self._err.get(kind)
        if c is None:
            c = self._err[kind] = self.errors.labels(kind)
        c.inc()


def _host_port(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)


class Gateway:
    """The gateway of one model. See the module docstring.

    ``edges``: the best-fit DB's sequence buckets (the samples' buckets; the largest bounds a
    request). ``max_context``: the model's context length. ``tokenizer``: a ``str -> int``
    counter (:func:`dse.tokens.load_tokenizer`), default the estimate
    :func:`dse.tokens.count_tokens`. ``predictor``: a :class:`router.predict.LengthPredictor`,
    default :class:`router.predict.MedianPredictor`.
    """

    def __init__(self, model: str, edges: Sequence[int] = SEQ_BUCKETS, max_context: int = 8192,
                 *, api_key: str | None = None, tokenizer: TokenCounter | None = None,
                 predictor: LengthPredictor | None = None, wait_for_vpod_s: float = 30.0,
                 retry_after_s: float = 5.0, upstream_timeout_s: float = 60.0,
                 connect_timeout_s: float = 5.0, quarantine_s: float = 5.0,
                 continuation: str = "kv", upstream_api_key: str | None = None):
        self.model = model
        if continuation not in ("kv", "text"):
            raise ValueError("continuation must be 'kv' or 'text'")
        # how a request continues on another engine (P/D hand-off, migration, fail-over):
        # "kv" - kv_transfer_params name the KV's source and generated_tokens (engines with a
        # KV connector; the sim engines); "text" - the text so far is resent (any vLLM)
        self.continuation = continuation
        self.edges = tuple(int(e) for e in edges)
        if not self.edges or max_context < 2:
            raise ValueError("edges must be non-empty and max_context >= 2")
        self.max_context = int(max_context)
        self.context_limit = min(self.max_context, self.edges[-1])
        self._api_key = api_key.encode() if api_key else None
        self._count = tokenizer or count_tokens
        self._count_offload = tokenizer is not None     # a real tokenizer releases the GIL
        self._default_predictor = MedianPredictor(self.edges)
        self.predictor = predictor if predictor is not None else self._default_predictor
        self.wait_for_vpod_s = float(wait_for_vpod_s)
        self.retry_after_s = max(1, int(math.ceil(retry_after_s)))
        self.quarantine_s = float(quarantine_s)
        self.client = EngineClient(connect_timeout_s=connect_timeout_s,
                                   read_timeout_s=upstream_timeout_s, api_key=upstream_api_key)
        self.metrics = GatewayMetrics()
        active = self.predictor
        self.metrics.predictor.labels(
            getattr(active, "name", type(active).__name__),
            getattr(active, "configured", getattr(active, "name", type(active).__name__))).set(1)
        self.status_provider: Callable[[], dict] | None = None
        # called with a record of every answered request (the served-request log)
        self.on_request_done: Callable[[dict[str, Any]], None] | None = None
        # a controller plans when it sees demand: with no routing table yet, requests wait
        # (up to wait_for_vpod_s) instead of an immediate 503
        self.plans_on_demand = False
        # told the id of a vPod that failed under a request (a controller checks it at once and
        # replaces it if dead); with it, a request whose group has no other vPod waits for the
        # replacement (up to wait_for_vpod_s) instead of failing
        self.on_vpod_failed: Callable[[str], None] | None = None
        self._targets: _Targets | None = None
        self._changed = asyncio.Event()
        self._loads: dict[str, _Load] = {}
        self._bad_until: dict[str, float] = {}
        nb = len(self.edges)
        self._tok = {ph: [0.0] * nb for ph in PHASES}
        self._admitted = 0
        self._in_flight = 0
        self._waiting: dict[tuple[str, Hashable], int] = {}
        self._wait_peak: dict[tuple[str, Hashable], int] = {}
        self._longest: dict[tuple[str, Hashable], float] = {}
        self._stay: dict[tuple[str, int], list] = {}
        self._last_sample = _now()
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._bg: set[asyncio.Future] = set()     # background tasks (strong references)

    # ---- the controller's API ------------------------------------------------------------------
    def set_targets(self, tables: Mapping[str, RoutingTable],
                    endpoints: Mapping[tuple[str, Hashable], Sequence[Endpoint]],
                    starting: Collection[tuple[str, Hashable]] = ()) -> None:
        """Swap the routing state at once. ``tables``: phase -> routing table; ``"decode"``
        serves requests (none yet: 503), ``"prefill"`` turns on P/D disaggregation (without it
        a request is served whole by the decode group). ``endpoints``: (phase, group) -> the
        group's READY vPods. ``starting``: the (phase, group) pairs with vPods starting (a
        request for such a group with no ready vPod waits up to ``wait_for_vpod_s`` instead of
        a 503). Requests in flight keep their vPods (drain); waiting ones re-route on the new
        state."""
        for ph, t in tables.items():
            if ph not in PHASES or not isinstance(t, RoutingTable):
                raise ValueError(f"bad routing table for phase {ph!r}")
        eps: dict[tuple[str, Hashable], tuple[Endpoint, ...]] = {}
        for (ph, g), lst in endpoints.items():
            if ph not in PHASES:
                raise ValueError(f"bad phase {ph!r} in endpoints")
            eps[(ph, g)] = tuple(e if not e.url.endswith("/") else
                                 Endpoint(e.vpod_id, e.url.rstrip("/"), e.throughput_tok_per_s,
                                          e.max_batch) for e in lst)
        self._targets = _Targets(dict(tables), eps, frozenset(starting))
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def take_samples(self) -> Samples:
        """Tokens per bucket and the peak waits since the previous call (then reset)."""
        now = _now()
        dt, self._last_sample = now - self._last_sample, now
        nb = len(self.edges)
        tokens = {ph: np.asarray(v, dtype=float) for ph, v in self._tok.items()}
        self._tok = {ph: [0.0] * nb for ph in PHASES}
        waiting = {k: v for k, v in self._wait_peak.items() if v > 0}
        self._wait_peak = {k: v for k, v in self._waiting.items() if v > 0}
        n, self._admitted = self._admitted, 0
        longest, self._longest = self._longest, {}
        stay, self._stay = self._stay, {}
        return Samples(dt, tokens, waiting, n, longest, stay)

    def outstanding(self, vpod_id: str) -> int:
        """Requests in flight on a vPod (a vPod is drained when this is 0)."""
        ld = self._loads.get(vpod_id)
        return ld.requests if ld is not None else 0

    def status(self) -> dict[str, Any]:
        t = self._targets
        gw = {"model": self.model, "in_flight": self._in_flight,
              "outstanding": {v: ld.requests for v, ld in self._loads.items() if ld.requests},
              "waiting": {f"{p}/{g}": n for (p, g), n in self._waiting.items() if n},
              "groups": {} if t is None else
              {f"{p}/{g}": [e.vpod_id for e in eps] for (p, g), eps in t.endpoints.items()},
              "starting": [] if t is None else sorted(f"{p}/{g}" for p, g in t.starting)}
        out = {"gateway": gw}
        if self.status_provider is not None:
            out.update(self.status_provider())
        return out

    # ---- the app -------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", partial(self._serve, kind=COMPLETIONS))
        app.router.add_post("/v1/chat/completions", partial(self._serve, kind=CHAT))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/status", self._admin_status)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.client.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.client.close()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve :meth:`app` (handler cancellation on, no access log); returns its URL."""
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        # listen backlog: the default 128 refuses connections at ~1000 concurrent clients
        # (benchmarks/router_overhead.py); the kernel caps it at net.core.somaxconn
        await web.TCPSite(self._runner, host, port, backlog=4096).start()
        h, p = self._runner.addresses[0][:2]
        return f"http://{h}:{p}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.client.close()

    # ---- small endpoints -----------------------------------------------------------------------
    def _auth(self, request: web.Request) -> None:
        if self._api_key is None:
            return
        h = request.headers.get("Authorization", "")
        if not h.startswith("Bearer "):
            raise unauthorized(bool(h))
        if not hmac.compare_digest(h[7:].strip().encode(), self._api_key):
            raise unauthorized(True)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._auth(request)
        except APIError as e:
            return self._refuse(e, "models")
        self.metrics.answered("models", 200)
        return web.json_response(models_response(self.model, self.context_limit, self._created))

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _admin_status(self, request: web.Request) -> web.Response:
        try:
            self._auth(request)
        except APIError as e:
            return self._refuse(e, "admin")
        return web.json_response(self.status(), dumps=partial(json.dumps, default=str))

    def _refuse(self, e: APIError, endpoint: str) -> web.Response:
        self.metrics.error(e.kind)
        self.metrics.answered(endpoint, e.status)
        return e.response()

    # ---- completions ---------------------------------------------------------------------------
    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        t0 = _perf()
        try:
            self._auth(request)
            req = parse_request(kind, await request.read())
            if req.model != self.model:
                raise model_not_found(req.model)
            f = await self._admit(req, t0)
        except APIError as e:
            return self._refuse(e, kind)
        m = self.metrics
        m.in_flight.inc()
        self._in_flight += 1
        status = 200
        try:
            if req.stream:
                resp, status = await self._stream(request, f)
            else:
                resp, status = await self._whole(request, f)
            return resp
        except asyncio.CancelledError:
            status = 499
            m.error("client_disconnect")
            raise
        finally:
            m.in_flight.dec()
            self._in_flight -= 1
            m.answered(kind, status)
            if status == 200:
                self._finished(f)
            if self.on_request_done is not None:
                self._record(f, kind, status)

    def _finished(self, f: _Flight) -> None:
        m = self.metrics
        t_end = _perf()
        m.e2e.observe(t_end - f.t0)
        if f.t_first is not None and f.generated > 1:
            m.tpot.observe((t_end - f.t_first) / (f.generated - 1))
            if f.group is not None:
                key = ("decode", f.group)
                if t_end - f.t_first > self._longest.get(key, 0.0):
                    self._longest[key] = t_end - f.t_first
            if f.est > 1:                  # its decode load was counted at this bucket
                self._note_stay("decode", f.prompt_tokens + f.est, t_end - f.t_first)
        if f.finish == "stop" and not f.req.ignore_eos and f.generated > 0:
            if f.group0 is not None:
                m.prediction(f.group0, f.est0, f.generated,
                             self._bucket(f.est0) == self._bucket(f.generated))
            self._default_predictor.observe(f.prompt_tokens, f.generated)
            if self.predictor is not self._default_predictor:
                try:
                    r = self.predictor.observe(f.prompt_tokens, f.generated)
                    if inspect.isawaitable(r):
                        t = asyncio.ensure_future(r)
                        self._bg.add(t)
                        t.add_done_callback(self._bg.discard)
                except Exception:  # noqa: BLE001 - a predictor's bug must not fail a request
                    log.debug("predictor.observe failed", exc_info=True)

    def _record(self, f: _Flight, kind: str, status: int) -> None:
        """Hand the served-request log one record (the prompt too: the hook decides whether to
        keep it)."""
        t_end = _perf()
        ttft = f.t_first - f.t0 if f.t_first is not None else None
        tpot = (t_end - f.t_first) / (f.generated - 1) \
            if f.t_first is not None and f.generated > 1 else None
        try:
            self.on_request_done({
                "id": f"{id(f):x}-{int(time.time() * 1e6):x}", "t": time.time(),
                "endpoint": kind, "status": status, "prompt_tokens": f.prompt_tokens,
                "output_tokens": f.generated, "predicted_tokens": f.est0,
                "prefill_group": None, "decode_group": None if f.group is None else str(f.group),
                "migrations": f.migrations, "ttft_s": ttft, "tpot_s": tpot,
                "e2e_s": t_end - f.t0, "finish_reason": f.finish, "prompt": f.req.prompt})
        except Exception:  # noqa: BLE001 - the log must never fail a request
            log.warning("request log hook failed", exc_info=True)

    def _first_text(self, f: _Flight) -> None:
        f.t_first = _perf()
        self.metrics.ttft.observe(f.t_first - f.t0)

    async def _stream(self, request: web.Request, f: _Flight) -> tuple[web.StreamResponse, int]:
        req = f.req
        fmt = Formatter(req.kind, req.model)
        cont = req.continuous_usage
        resp: web.StreamResponse | None = None
        ended = False
        try:
            async with contextlib.aclosing(self._generate(f, request)) as gen:
                async for text, finish in gen:
                    out = b""
                    if resp is None:      # headers go out with the first chunk (coalesced)
                        resp = _SSEResponse(headers=_SSE_HEADERS)
                        await resp.prepare(request)
                        if req.kind == CHAT:
                            out = fmt.role_chunk(usage_json(f.usage_prompt, 0) if cont
                                                 else None)
                    if text or finish:
                        if text and f.t_first is None:
                            self._first_text(f)
                        out += fmt.text_chunk(
                            text, finish,
                            usage_json(f.usage_prompt, f.generated) if cont else None)
                    if finish is not None:          # the end: one write with [DONE]
                        if req.include_usage:
                            out += fmt.usage_chunk(usage_json(f.usage_prompt, f.generated))
                        await resp.write_eof(out + Formatter.DONE)
                        ended = True
                    elif out:
                        await resp.write(out)
            if not ended:           # cannot happen: the generator ends with a finish or raises
                raise upstream_error("the stream ended without a finish_reason")
            return resp, 200
        except APIError as e:
            self.metrics.error(e.kind)
            if resp is None:
                return e.response(), e.status
            with contextlib.suppress(ConnectionError):
                await resp.write(fmt.error_event(e) + Formatter.DONE)
                await resp.write_eof()
            return resp, e.status
        except (ConnectionError, ClientGone):
            self.metrics.error("client_disconnect")
            return resp if resp is not None else web.Response(status=499), 499
        except Exception:  # noqa: BLE001 - a bug must still answer, and be seen
            log.exception("request failed")
            err = internal_error()
            self.metrics.error(err.kind)
            if resp is None:
                return err.response(), err.status
            with contextlib.suppress(ConnectionError):
                await resp.write(fmt.error_event(err) + Formatter.DONE)
                await resp.write_eof()
            return resp, err.status

    async def _whole(self, request: web.Request, f: _Flight) -> tuple[web.StreamResponse, int]:
        parts: list[str] = []
        try:
            async with contextlib.aclosing(self._generate(f, request)) as gen:
                async for text, _finish in gen:
                    if text:
                        if f.t_first is None:
                            self._first_text(f)
                        parts.append(text)
        except APIError as e:
            self.metrics.error(e.kind)
            return e.response(), e.status
        except (ConnectionError, ClientGone):
            self.metrics.error("client_disconnect")
            return web.Response(status=499), 499
        except Exception:  # noqa: BLE001 - a bug must still answer, and be seen
            log.exception("request failed")
            err = internal_error()
            self.metrics.error(err.kind)
            return err.response(), err.status
        fmt = Formatter(f.req.kind, f.req.model)
        body = fmt.response("".join(parts), f.finish, f.usage_prompt, f.generated)
        return web.Response(body=body, content_type="application/json"), 200

    # ---- admission: tokens, context, prediction ------------------------------------------------
    async def _admit(self, req: ParsedRequest, t0: float) -> _Flight:
        text = req.prompt
        if self._count_offload and len(text) > 32768:
            p = await asyncio.to_thread(self._count, text)
        else:
            p = self._count(text)
        p = max(1, int(p))
        limit = self.context_limit
        mt = req.max_tokens
        if mt is None:
            if p >= limit:
                raise context_length_exceeded(limit, p, None, req.prompt_param)
            mt = min(DEFAULT_COMPLETION_MAX_TOKENS, limit - p) if req.kind == COMPLETIONS \
                else limit - p
        elif p + mt > limit:
            raise context_length_exceeded(limit, p, mt, req.prompt_param)
        if req.ignore_eos:
            est = mt
        else:
            est = await self._ask("predict", text, p)
            est = min(max(est, req.min_tokens, 1), mt)
        self._admitted += 1
        # the load the controller sees, counted at admission (also for a request that finds
        # no vPod: demand must be visible for the controller to plan any): prefill by input
        # length, decode the predicted output by input + predicted output
        self._tok["prefill"][self._bucket(p)] += p
        if est > 1:
            self._tok["decode"][self._bucket(p + est)] += est
        return _Flight(req, p, mt, est, t0, self.continuation == "text")

    async def _tables_or_wait(self, http_req: web.Request | None) -> _Targets:
        """The routing state, once it can serve (a decode table). With none yet - a cold start,
        or every group scaled to zero - and ``plans_on_demand`` (a controller plans as soon as
        it sees the demand this request added), wait up to ``wait_for_vpod_s`` for it; then
        503 with Retry-After."""
        deadline = _now() + (self.wait_for_vpod_s if self.plans_on_demand else 0.0)
        while True:
            t = self._targets
            if t is not None and "decode" in t.tables:
                return t
            now = _now()
            if now >= deadline:
                self._note_wait(("decode", None), 1)
                self._note_wait(("decode", None), -1)
                raise no_vpod(self.retry_after_s, "no routing table yet")
            ev = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ev.wait(), min(deadline - now, 0.5))
            if http_req is not None and http_req.transport is None:
                raise ClientGone()

    def _note_stay(self, phase: str, length: int, seconds: float) -> None:
        acc = self._stay.setdefault((phase, self._bucket(length)), [0.0, 0])
        acc[0] += seconds
        acc[1] += 1

    def _bucket(self, length: int) -> int:
        return min(bisect_left(self.edges, max(1, length)), len(self.edges) - 1)

    async def _ask(self, method: str, *args: Any) -> int:
        """The predictor's answer, or the default's when it fails (counted)."""
        p = self.predictor
        try:
            r = getattr(p, method)(*args)
            if inspect.isawaitable(r):
                r = await r
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not r >= 0 or \
                    not math.isfinite(r):
                raise ValueError(f"predictor answered {r!r}")
            return int(r)
        except Exception:  # noqa: BLE001 - any failure of a pluggable predictor falls back
            if p is self._default_predictor:
                raise
            log.debug("predictor.%s failed; the default answers", method, exc_info=True)
            self.metrics.fallbacks.inc()
            return int(getattr(self._default_predictor, method)(*args))

    # ---- vPod choice ---------------------------------------------------------------------------
    def _load_of(self, ep: Endpoint) -> float:
        ld = self._loads.get(ep.vpod_id)
        if ld is None:
            return 0.0
        return ld.tokens / max(ep.throughput_tok_per_s, 1e-9) + ld.requests / max(ep.max_batch, 1)

    def _held(self, ep: Endpoint) -> float:
        """The share of ``ep``'s batch slots its requests in flight take."""
        ld = self._loads.get(ep.vpod_id)
        return 0.0 if ld is None else ld.requests / max(ep.max_batch, 1)

    def _acquire(self, ep: Endpoint, tokens: float) -> None:
        ld = self._loads.get(ep.vpod_id)
        if ld is None:
            ld = self._loads[ep.vpod_id] = _Load()
        ld.requests += 1
        ld.tokens += tokens

    def _release(self, ep: Endpoint, tokens: float) -> None:
        ld = self._loads.get(ep.vpod_id)
        if ld is None:
            return
        ld.requests -= 1
        ld.tokens -= tokens
        if ld.requests <= 0:
            del self._loads[ep.vpod_id]

    def _failed(self, ep: Endpoint, phase: str, e: UpstreamFailure, f: _Flight) -> None:
        log.warning("vPod %s failed during %s (%s); continuing elsewhere", ep.vpod_id, phase, e)
        self._bad_until[ep.vpod_id] = _now() + self.quarantine_s
        self.metrics.error(f"upstream_{e.kind}")
        self.metrics.failovers.inc()
        f.failovers += 1
        if self.on_vpod_failed is not None:
            try:
                self.on_vpod_failed(ep.vpod_id)
            except Exception:  # noqa: BLE001 - the report is advisory
                log.debug("on_vpod_failed raised", exc_info=True)

    def _note_wait(self, key: tuple[str, Hashable], d: int) -> None:
        n = self._waiting.get(key, 0) + d
        self._waiting[key] = n
        if n > self._wait_peak.get(key, 0):
            self._wait_peak[key] = n
        self.metrics.waiting.labels(key[0], str(key[1])).set(n)

    async def _pick(self, phase: str, f: _Flight, excluded: set[str],
                    http_req: web.Request | None, failover: bool
                    ) -> tuple[Hashable, Endpoint]:
        """The least-loaded vPod of the request's group (decode: of its vPods with a batch
        slot free, if any - :func:`router.routing.free_slot_first`; after a failure: of the
        group, else of the longer groups), waiting for starting vPods up to
        ``wait_for_vpod_s``."""
        deadline = None
        while True:
            t = self._targets
            table = t.tables.get(phase) if t is not None else None
            if table is None:
                raise no_vpod(self.retry_after_s, "no routing table yet")
            if phase == "prefill":
                group = table.group_for_length(f.prompt_tokens)
            elif f.group is not None and f.group in table.best_len:
                group = f.group
            else:
                group = table.group_for_length(f.prompt_tokens + max(f.est, f.generated))
            eps = t.endpoints
            g = group
            cands = [e for e in eps.get((phase, g), ()) if e.vpod_id not in excluded]
            if not cands and phase == "decode" and not failover:
                # nothing up in the predicted length's group: a ready group that holds the
                # sequence starts it now (routing.ready_group; migration moves it on later)
                alt = ready_group(table, group, f.prompt_tokens + f.generated, lambda x: any(
                    e.vpod_id not in excluded for e in eps.get((phase, x), ())))
                if alt is not None:
                    g = alt
                    cands = [e for e in eps.get((phase, g), ()) if e.vpod_id not in excluded]
            if failover and not cands and (phase, group) not in t.starting:
                while not cands:
                    g = table.longer_group(g)
                    if g is None:
                        break
                    cands = [e for e in eps.get((phase, g), ()) if e.vpod_id not in excluded]
            if cands:
                if len(cands) > 1:
                    if self._bad_until:
                        now = _now()
                        cands = [e for e in cands if self._bad_until.get(e.vpod_id, 0) <= now] \
                            or cands
                    ep = (least_loaded(cands, self._load_of) if phase == "prefill" else
                          free_slot_first(cands, self._held, self._load_of))
                else:
                    ep = cands[0]
                self.metrics.routed_to(phase, g)
                return g, ep
            key = (phase, group)
            now = _now()
            if key in t.starting or (failover and self.on_vpod_failed is not None):
                if deadline is None:
                    deadline = now + self.wait_for_vpod_s
                if now < deadline:
                    self._note_wait(key, 1)
                    try:
                        ev = self._changed
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(ev.wait(), min(deadline - now, 0.5))
                    finally:
                        self._note_wait(key, -1)
                    if http_req is not None and http_req.transport is None:
                        raise ClientGone()
                    continue
            self._note_wait(key, 1)
            self._note_wait(key, -1)
            raise no_vpod(self.retry_after_s, f"no ready vPod in {phase} group {group}")

    # ---- one request's token stream ------------------------------------------------------------
    async def _generate(self, f: _Flight, http_req: web.Request | None
                        ) -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish_reason) pieces in order, whatever vPods serve them; ``finish_reason``
        is set on the last. Raises :class:`APIError` when the request cannot be served."""
        t = await self._tables_or_wait(http_req)
        if "prefill" in t.tables:
            text, finish = await self._prefill(f, http_req)
            f.opened = True
            yield text, finish
            if finish is not None:
                return
        excluded: set[str] = set()
        failover = False
        count = self._count
        kind_chat = f.req.kind == CHAT
        while True:
            group, ep = await self._pick("decode", f, excluded, http_req, failover)
            f.group = group
            if f.group0 is None:
                f.group0 = group
            body = f.body(stream=True, max_tokens=f.max_tokens, kv=f.decode_kv())
            load = max(f.est - f.generated, 1)
            self._acquire(ep, load)
            stream = None
            produced = False
            migrate_to = None
            try:
                stream = await self.client.stream(ep.url + f.path, body)
                async for chunk in stream:
                    choices = chunk.get("choices")
                    text, finish = "", None
                    if choices:
                        c0 = choices[0]
                        if kind_chat:
                            d = c0.get("delta")
                            text = (d.get("content") or "") if d else ""
                        else:
                            text = c0.get("text") or ""
                        finish = c0.get("finish_reason")
                    old = f.generated
                    u = chunk.get("usage")
                    if u:
                        f.generated = f.gen_base + u.get("completion_tokens", old - f.gen_base)
                        if f.engine_prompt is None:
                            f.engine_prompt = u.get("prompt_tokens")
                    elif text:
                        f.generated = old + count(text)
                    if f.generated > old:
                        produced = True
                    if text or finish or not f.opened:
                        f.opened = True
                        if text and f.text_mode:
                            f.text_out.append(text)
                        yield text, finish
                    if finish is not None:
                        f.finish = finish
                        await self._drain(stream, f)
                        return
                    if http_req is not None and http_req.transport is None:
                        raise ClientGone()
                    if f.generated > old:
                        migrate_to = await self._check_boundary(f, group, old)
                        if migrate_to is not None:
                            break
                else:
                    raise UpstreamFailure("broken", "stream ended without a finish_reason")
            except UpstreamFailure as e:
                self._failed(ep, "decode", e, f)
                excluded.add(ep.vpod_id)
                failover = True
                if produced:
                    f.kv = None         # its KV died with it: the next vPod recomputes
                continue
            except UpstreamRejected as e:
                if not f.opened:
                    raise self._passthrough(e) from None
                self._failed(ep, "decode", UpstreamFailure("status", f"{e.status}"), f)
                excluded.add(ep.vpod_id)
                failover = True
                continue
            finally:
                if stream is not None:
                    stream.close()
                self._release(ep, load)
            # a migration (§3.4): continue on the target group, the KV comes from this vPod
            host, port = _host_port(ep.url)
            f.kv = {"do_remote_prefill": True, "remote_engine_id": ep.vpod_id,
                    "remote_host": host, "remote_port": port,
                    "kv_tokens": f.prompt_tokens + f.generated - 1}
            log.debug("request migrates from %s (%s) to group %s at %d tokens", ep.vpod_id,
                      group, migrate_to, f.generated)
            f.group = migrate_to
            f.migrations += 1
            self.metrics.migrations.inc()
            excluded = set()
            failover = False

    async def _drain(self, stream, f: _Flight) -> None:
        """After the finish chunk: read the trailing usage chunk and [DONE] (a few chunks at
        most) so the connection returns to the pool."""
        try:
            for _ in range(4):
                chunk = await stream.__anext__()
                u = chunk.get("usage")
                if u:
                    f.generated = max(f.generated, f.gen_base + u.get("completion_tokens", 0))
        except (StopAsyncIteration, UpstreamFailure):
            pass

    async def _check_boundary(self, f: _Flight, group: Hashable, old: int) -> Hashable | None:
        """At a bucket boundary: re-predict, and the group to migrate to (or None)."""
        t = self._targets
        table = t.tables.get("decode") if t is not None else None
        if table is None:
            return None
        p = f.prompt_tokens
        if not crossed_bucket(table, p + old, p + f.generated):
            return None
        if f.req.ignore_eos:
            est = f.max_tokens
        else:
            est = await self._ask("repredict", f.req.prompt, p, f.generated)
            est = min(max(est, f.generated + 1, f.min_tokens), f.max_tokens)
        f.est = est
        target = should_migrate(table, group, p + f.generated, p + est)
        if target is None or target == group or not t.endpoints.get(("decode", target)):
            return None
        return target

    async def _prefill(self, f: _Flight, http_req: web.Request | None
                       ) -> tuple[str, str | None]:
        """The prompt's prefill and first token on the prefill group; (text, finish_reason or
        None when decode continues)."""
        excluded: set[str] = set()
        handoff = f.max_tokens > 1
        body = f.body(stream=False, max_tokens=1,
                      kv={"do_remote_decode": True} if handoff else None)
        failover = False
        while True:
            _, ep = await self._pick("prefill", f, excluded, http_req, failover)
            self._acquire(ep, f.prompt_tokens)
            t_sent = _perf()
            try:
                data = await self.client.post_json(ep.url + f.path, body)
                self._note_stay("prefill", f.prompt_tokens, _perf() - t_sent)
                break
            except UpstreamFailure as e:
                self._failed(ep, "prefill", e, f)
                excluded.add(ep.vpod_id)
                failover = True
            except UpstreamRejected as e:
                raise self._passthrough(e) from None
            finally:
                self._release(ep, f.prompt_tokens)
        c0 = data["choices"][0] if data.get("choices") else {}
        if f.req.kind == CHAT:
            text = (c0.get("message") or {}).get("content") or ""
        else:
            text = c0.get("text") or ""
        finish = c0.get("finish_reason")
        u = data.get("usage") or {}
        f.generated = int(u.get("completion_tokens", 1))
        f.engine_prompt = u.get("prompt_tokens")
        if text:
            self._first_text(f)
            if f.text_mode:
                f.text_out.append(text)
        if f.generated >= f.max_tokens or not handoff or \
                (finish == "stop" and f.generated >= f.min_tokens):
            f.finish = finish or "length"
            return text, f.finish
        kv = data.get("kv_transfer_params")
        f.kv = dict(kv) if isinstance(kv, dict) else None
        return text, None

    @staticmethod
    def _passthrough(e: UpstreamRejected) -> APIError:
        err = e.body.get("error") if isinstance(e.body, dict) else None
        err = err if isinstance(err, dict) else {}
        kind = "context_length" if err.get("code") == "context_length_exceeded" else "bad_request"
        return APIError(e.status, str(err.get("message") or "the engine refused the request"),
                        type=str(err.get("type") or "invalid_request_error"),
                        param=err.get("param"), code=err.get("code"), kind=kind)


# ---- stand-alone: the gateway in front of fixed engines ----------------------------------------

def _parser():
    import argparse
    ap = argparse.ArgumentParser(
        prog="python -m router.gateway",
        description="The OpenAI-compatible gateway in front of fixed engine URLs (one decode "
                    "group, optionally one prefill group for P/D); `orchestrator serve` runs it "
                    "with the controller's routing instead.")
    ap.add_argument("--model", required=True, help="the model name clients ask for")
    ap.add_argument("--decode", action="append", required=True, metavar="URL",
                    help="an engine that decodes (repeatable)")
    ap.add_argument("--prefill", action="append", default=[], metavar="URL",
                    help="an engine that prefills (repeatable; turns P/D on)")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tokenizer", default=None, metavar="PATH",
                    help="a local Hugging Face tokenizer.json (or its folder) to count prompt "
                         "tokens with (needs the 'tokenizers' package); default: the estimate "
                         "of dse.tokens.count_tokens")
    ap.add_argument("--api-key-env", default=None, metavar="VAR",
                    help="require 'Authorization: Bearer <the value of $VAR>'")
    ap.add_argument("--wait-for-vpod-s", type=float, default=30.0)
    return ap


def gateway_from_args(args) -> Gateway:
    """The gateway ``python -m router.gateway`` serves (targets set)."""
    import os
    from dse.errors import NeuScaleError
    from dse.tokens import load_tokenizer
    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            raise NeuScaleError(f"--api-key-env {args.api_key_env}: the variable is not set")
    gw = Gateway(args.model, SEQ_BUCKETS, args.max_context, api_key=key,
                 tokenizer=load_tokenizer(args.tokenizer) if args.tokenizer else None,
                 wait_for_vpod_s=args.wait_for_vpod_s)
    tables = {"decode": RoutingTable.build({0: "decode"})}
    eps = {("decode", "decode"): [Endpoint(f"decode-{i}", u) for i, u in
                                  enumerate(args.decode)]}
    if args.prefill:
        tables["prefill"] = RoutingTable.build({0: "prefill"})
        eps[("prefill", "prefill")] = [Endpoint(f"prefill-{i}", u) for i, u in
                                       enumerate(args.prefill)]
    gw.set_targets(tables, eps)
    return gw


def main(argv: list[str] | None = None) -> int:
    import sys
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        gw = gateway_from_args(args)
    except ValueError as e:               # NeuScaleError: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    web.run_app(gw.app(), host=args.host, port=args.port, access_log=None,
                handler_cancellation=True, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
