"""Test helpers for the gateway: an event loop in a thread (so the synchronous ``openai`` client
can talk to servers on it) and a small fault-injecting engine that speaks the design's §1
protocol (the real sim engine servers are used where they exist; this one makes failures the
real ones cannot: 5xx, stalls, resets after N tokens)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from typing import Any

from aiohttp import web

from dse.tokens import chat_prompt, count_tokens

VOCAB = ("alpha", "bravo", "delta", "echo", "gamma", "hotel", "india", "kilo", "lima", "mike",
         "oscar", "papa", "romeo", "sierra", "tango", "victor", "whisky", "yankee", "zulu")


class LoopThread:
    """An asyncio loop running in a daemon thread; :meth:`run` a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._t = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._t.start()

    def run(self, coro, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args) -> Any:
        async def _c():
            return fn(*args)
        return self.run(_c())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._t.join(5)


def word(prompt: str, seed: int, i: int) -> str:
    h = hashlib.blake2b(f"{seed}|{i}|{prompt}".encode(), digest_size=4).digest()
    return " " + VOCAB[int.from_bytes(h, "little") % len(VOCAB)]


def intrinsic_len(prompt: str, seed: int) -> int:
    h = hashlib.blake2b(f"len|{seed}|{prompt}".encode(), digest_size=4).digest()
    return 20 + int.from_bytes(h, "little") % 100


class FakeEngine:
    """``fail``: None | "500" (every call answers 500) | ("reset", n) (the connection is
    aborted after n tokens of a stream) | ("stall", n) (the stream stops sending after n
    tokens)."""

    def __init__(self, vpod_id: str, model: str = "m", *, tick_s: float = 0.005,
                 per_tick: int = 2, max_model_len: int = 8192, fail=None):
        self.vpod_id = vpod_id
        self.model = model
        self.tick_s = tick_s
        self.per_tick = per_tick
        self.max_model_len = max_model_len
        self.fail = fail
        self.running = 0
        self.bodies: list[dict] = []
        self.aborted = 0
        self._runner: web.AppRunner | None = None
        self._transports: set = set()
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def kill(self) -> None:
        for tr in list(self._transports):
            tr.abort()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request):
        return web.json_response({})

    async def _metrics(self, request):
        return web.Response(text=f'vllm:num_requests_running{{model_name="{self.model}"}} '
                                 f'{self.running}\n')

    async def _handle(self, request: web.Request):
        self._transports.add(request.transport)
        body = await request.json()
        self.bodies.append(body)
        if self.fail == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        chat = "messages" in body
        prompt = chat_prompt(body["messages"]) if chat else body["prompt"]
        p = count_tokens(prompt)
        seed = body.get("seed") or 0
        max_tokens = body.get("max_tokens") or 16
        if p + max_tokens > self.max_model_len:
            return web.json_response({"error": {"message": "too long", "type": "BadRequestError",
                                                "param": None,
                                                "code": "context_length_exceeded"}}, status=400)
        kv = body.get("kv_transfer_params") or {}
        k = int(kv.get("generated_tokens", 0))
        natural = 10 ** 9 if body.get("ignore_eos") else max(intrinsic_len(prompt, seed),
                                                             body.get("min_tokens") or 0)
        end = min(natural, max_tokens)
        finish = "length" if end == max_tokens and natural > max_tokens else "stop"
        rid = ("chatcmpl-" if chat else "cmpl-") + self.vpod_id + str(len(self.bodies))
        self.running += 1
        try:
            if not body.get("stream"):
                await asyncio.sleep(self.tick_s)
                text = "".join(word(prompt, seed, i) for i in range(k, end))
                choice = {"index": 0, "finish_reason": finish}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                out = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                       "created": int(time.time()), "model": self.model, "choices": [choice],
                       "usage": {"prompt_tokens": p, "completion_tokens": end,
                                 "total_tokens": p + end}}
                if kv.get("do_remote_decode"):
                    out["kv_transfer_params"] = {
                        "do_remote_prefill": True, "remote_engine_id": self.vpod_id,
                        "remote_host": "127.0.0.1", "remote_port": 1, "kv_tokens": p}
                return web.json_response(out)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            obj = "chat.completion.chunk" if chat else "text_completion"
            cont = (body.get("stream_options") or {}).get("continuous_usage_stats")

            def chunk(text, fr, n, role=False):
                c = {"index": 0, "finish_reason": fr}
                if chat:
                    c["delta"] = {"role": "assistant", "content": ""} if role else \
                        {"content": text}
                else:
                    c["text"] = text
                d = {"id": rid, "object": obj, "created": 0, "model": self.model,
                     "choices": [c]}
                if cont:
                    d["usage"] = {"prompt_tokens": p, "completion_tokens": n,
                                  "total_tokens": p + n}
                return f"data: {json.dumps(d)}\n\n".encode()

            if chat:
                await resp.write(chunk("", None, k, role=True))
            i = k
            if i >= end:
                await resp.write(chunk("", finish, i))
            while i < end:
                await asyncio.sleep(self.tick_s)
                j = min(end, i + self.per_tick)
                if isinstance(self.fail, tuple) and j - k > self.fail[1]:
                    if self.fail[0] == "reset":
                        request.transport.abort()
                        return resp
                    await asyncio.sleep(3600)
                text = "".join(word(prompt, seed, x) for x in range(i, j))
                await resp.write(chunk(text, finish if j == end else None, j))
                i = j
            usage = {"prompt_tokens": p, "completion_tokens": end, "total_tokens": p + end}
            last = {"id": rid, "object": obj, "created": 0, "model": self.model,
                    "choices": [], "usage": usage}
            await resp.write(f"data: {json.dumps(last)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except (asyncio.CancelledError, ConnectionError):
            self.aborted += 1
            raise
        finally:
            self.running -= 1


async def http(method: str, url: str, body: bytes | None = None,
               headers: dict | None = None) -> tuple[int, dict, Any]:
    """One raw HTTP call: (status, headers, parsed JSON body or text)."""
    import aiohttp
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, data=body, headers=headers or {}) as r:
            raw = await r.read()
            try:
                out = json.loads(raw)
            except ValueError:
                out = raw.decode()
            return r.status, dict(r.headers), out


def direct_text(prompt: str, seed: int, n: int) -> str:
    """What a fake engine writes for tokens 0..n-1."""
    return "".join(word(prompt, seed, i) for i in range(n))


_SAMPLE = re.compile(r'^([^\s{]+)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_sum(text: str, query: str) -> float:
    """The sum of the Prometheus samples in ``text`` matching ``query``: a metric name with
    optional labels, ``name{a="x"}`` matching every sample of that name whose labels include
    those."""
    m = _SAMPLE.match(query + " 0")
    name, want = m.group(1), dict(_LABEL.findall(m.group(2) or ""))
    total = 0.0
    for line in text.splitlines():
        s = _SAMPLE.match(line)
        if s is None or s.group(1) != name:
            continue
        labels = dict(_LABEL.findall(s.group(2) or ""))
        if all(labels.get(k) == v for k, v in want.items()):
            total += float(s.group(3))
    return total
