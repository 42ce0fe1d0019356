"""The simulated engine server (backends/sim/engine_server.py): vLLM's OpenAI surface around the
chip model's engines, on real sockets on 127.0.0.1, driven by the wall clock. The ``openai``
client checks the response shapes; raw aiohttp checks what the gateway relies on (usage in
every chunk, the P/D hand-off, continuations, errors, metrics, a crash)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest
from openai import AsyncOpenAI

from backends.sim.engine_server import EngineServer, step_cost_table
from backends.sim.text import plan_output
from dse.catalog import default_catalog
from dse.models import load_model
from dse.tokens import chat_prompt, count_tokens
from sim.lifecycle import kv_transfer_s

MODEL = "llama3-8b"
ARCH = load_model(MODEL)
CAT = default_catalog()
V6E_DCN = CAT.get("v6e").dcn_bw_bytes_per_s


@pytest.fixture(scope="module")
def table():
    return step_cost_table(ARCH, CAT, "v6e", "1x1", 1)


@asynccontextmanager
async def running(table, phase="decode", vpod_id="v0", **kw):
    kw.setdefault("max_batch", 32)
    kw.setdefault("max_model_len", 8192)
    srv = EngineServer(served_model=MODEL, arch=ARCH, table=table, phase=phase,
                       vpod_id=vpod_id, dcn_bytes_per_s=V6E_DCN, **kw)
    await srv.start(0)
    try:
        yield srv
    finally:
        await srv.stop()


async def post(s: aiohttp.ClientSession, url: str, body: dict, chat: bool = False):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with s.post(url + path, json=body) as r:
        return r.status, await r.json()


async def stream(s: aiohttp.ClientSession, url: str, body: dict, chat: bool = False,
                 stop_after: int | None = None):
    """(chunks, arrival times) of a streamed call; ``stop_after``: close once that many
    completion tokens were reported (continuous usage)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    chunks, times = [], []
    async with s.post(url + path, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                chunks.append("[DONE]")
                break
            chunks.append(json.loads(payload))
            times.append(time.perf_counter())
            u = chunks[-1].get("usage")
            if stop_after is not None and u and u["completion_tokens"] >= stop_after:
                break
    return chunks, times


def text_of(chunks, chat=False):
    out = []
    for c in chunks:
        if c == "[DONE]" or not c["choices"]:
            continue
        ch = c["choices"][0]
        out.append((ch["delta"].get("content") or "") if chat else ch["text"])
    return "".join(out)


def prompt_with_length(lo: int, hi: int, seed=None) -> str:
    """A prompt whose intrinsic output length is in [lo, hi)."""
    for i in range(10000):
        p = f"Question {i}: what is the capital of the country?"
        n = plan_output(p, max_tokens=10 ** 6, seed=seed).total
        if lo <= n < hi:
            return p
    raise AssertionError("no such prompt")


def run(coro):
    return asyncio.run(coro)


# ---- the OpenAI surface, through the openai client -------------------------------------------

def test_openai_client_completions_whole_and_streamed(table):
    prompt = prompt_with_length(20, 60)
    want = plan_output(prompt, max_tokens=100)

    async def go():
        async with running(table) as srv:
            c = AsyncOpenAI(base_url=srv.url + "/v1", api_key="sim", max_retries=0)
            models = await c.models.list()
            assert [m.id for m in models.data] == [MODEL]
            r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=100)
            assert r.id.startswith("cmpl-") and r.object == "text_completion"
            ch = r.choices[0]
            assert ch.finish_reason == "stop" and ch.text == want.full_text()
            assert r.usage.prompt_tokens == count_tokens(prompt)
            assert r.usage.completion_tokens == want.total == count_tokens(ch.text)
            assert r.usage.total_tokens == r.usage.prompt_tokens + want.total
            # the default max_tokens of /v1/completions is 16
            r16 = await c.completions.create(model=MODEL, prompt=prompt)
            assert r16.usage.completion_tokens == 16 and r16.choices[0].finish_reason == "length"
            # streamed: the same text in pieces, the finish reason last, then the usage
            s = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                           stream=True, stream_options={"include_usage": True})
            chunks = [x async for x in s]
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
            body = [x for x in chunks if x.choices]
            assert body[-1].choices[0].finish_reason == "length"
            assert all(x.choices[0].finish_reason is None for x in body[:-1])
            assert "".join(x.choices[0].text for x in body) == want.text(0, 10)
            await c.close()

    run(go())


def test_openai_client_chat_whole_and_streamed(table):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three rivers."}]
    want = plan_output(chat_prompt(msgs), max_tokens=30, ignore_eos=True)

    async def go():
        async with running(table) as srv:
            c = AsyncOpenAI(base_url=srv.url + "/v1", api_key="sim", max_retries=0)
            r = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30,
                                                extra_body={"ignore_eos": True})
            assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
            m = r.choices[0].message
            assert m.role == "assistant" and m.content == want.full_text()
            assert r.choices[0].finish_reason == "length"
            assert r.usage.prompt_tokens == count_tokens(chat_prompt(msgs))
            assert r.usage.completion_tokens == 30
            s = await c.chat.completions.create(
                model=MODEL, messages=msgs, max_completion_tokens=30, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            chunks = [x async for x in s]
            assert chunks[0].object == "chat.completion.chunk"
            assert chunks[0].choices[0].delta.role == "assistant"
            assert chunks[0].choices[0].delta.content == ""
            body = [x for x in chunks if x.choices]
            assert "".join(x.choices[0].delta.content or "" for x in body) == want.full_text()
            assert body[-1].choices[0].finish_reason == "length"
            assert chunks[-1].usage.completion_tokens == 30
            await c.close()

    run(go())


# ---- vLLM's sampling rules and usage in every chunk ------------------------------------------

def test_stop_min_tokens_ignore_eos_and_continuous_usage(table):
    prompt = prompt_with_length(15, 30)
    eos = plan_output(prompt, max_tokens=10 ** 6).total
    full = plan_output(prompt, max_tokens=200, ignore_eos=True)
    toks = [full.text(i, i + 1) for i in range(40)]
    stop = toks[8] + toks[9]
    first = next(i for i in range(39) if toks[i] + toks[i + 1] == stop)

    async def go():
        async with running(table) as srv, aiohttp.ClientSession() as s:
            base = {"model": MODEL, "prompt": prompt}
            so = {"include_usage": True, "continuous_usage_stats": True}
            (_, r1), (_, r2), (_, r3), (_, r4), (chunks, _) = await asyncio.gather(
                post(s, srv.url, {**base, "max_tokens": 500}),
                post(s, srv.url, {**base, "max_tokens": 500, "min_tokens": eos + 7}),
                post(s, srv.url, {**base, "max_tokens": 40, "ignore_eos": True}),
                post(s, srv.url, {**base, "max_tokens": 40, "ignore_eos": True, "stop": stop}),
                stream(s, srv.url, {**base, "max_tokens": 40, "ignore_eos": True,
                                    "stop": [stop], "stream_options": so}))
            assert (r1["usage"]["completion_tokens"], r1["choices"][0]["finish_reason"]) == \
                (eos, "stop")
            assert (r2["usage"]["completion_tokens"], r2["choices"][0]["finish_reason"]) == \
                (eos + 7, "stop")
            assert (r3["usage"]["completion_tokens"], r3["choices"][0]["finish_reason"]) == \
                (40, "length")
            c0 = r4["choices"][0]
            assert c0["finish_reason"] == "stop" and c0["stop_reason"] == stop
            assert c0["text"] == "".join(toks[:first]) and stop not in c0["text"]
            assert r4["usage"]["completion_tokens"] == first + 2
            # streamed with a stop string: the pieces add up to the same cut text; with
            # continuous_usage_stats every chunk says how many tokens exist
            assert chunks[-1] == "[DONE]"
            assert text_of(chunks) == c0["text"]
            counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
            assert counts == sorted(counts) and counts[-1] == first + 2
            assert all(c["usage"]["prompt_tokens"] == count_tokens(prompt) for c in chunks[:-1])
            assert chunks[-2]["choices"] == []            # the include_usage chunk

    run(go())


@pytest.mark.parametrize("body, status, code, word", [
    ({"prompt": "hi", "max_tokens": 600}, 400, "context_length_exceeded",
     "maximum context length is 512"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model_not_found", "does not exist"),
    ({"prompt": "hi", "n": 2}, 400, None, "n must be 1"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None, "stream=True"),
    ({"prompt": "hi", "max_tokens": 5, "min_tokens": 9}, 400, None, "min_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, None, "max_tokens"),
    ({"prompt": 7}, 400, None, "prompt"),
    ({"prompt": "", "max_tokens": 4}, 400, None, "empty"),
    ({"prompt": "hi", "stop": 3}, 400, None, "stop"),
])
def test_bad_requests_get_openai_errors(table, body, status, code, word):
    async def go():
        async with running(table, max_model_len=512) as srv, aiohttp.ClientSession() as s:
            st, r = await post(s, srv.url, {"model": MODEL, **body})
            assert st == status
            assert set(r["error"]) == {"message", "type", "param", "code"}
            assert word in r["error"]["message"]
            if code:
                assert r["error"]["code"] == code
            async with s.post(srv.url + "/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400
            # chat without max_tokens: the rest of the context; a prompt beyond it is refused
            st, r = await post(s, srv.url, {"model": MODEL, "messages": [
                {"role": "user", "content": "word " * 600}]}, chat=True)
            assert st == 400 and r["error"]["code"] == "context_length_exceeded"

    run(go())


def test_a_request_longer_than_the_kv_cache_is_refused(table):
    async def go():
        async with running(table, max_model_len=200_000) as srv, aiohttp.ClientSession() as s:
            st, r = await post(s, srv.url, {"model": MODEL, "prompt": " a" * 100_000,
                                            "max_tokens": 4})
            assert st == 400 and "KV-cache tokens" in r["error"]["message"]
            st, r = await post(s, srv.url, {"model": MODEL, "prompt": "still fine",
                                            "max_tokens": 3})
            assert st == 200 and r["usage"]["completion_tokens"] == 3

    run(go())


# ---- P/D hand-off, migration and fail-over ---------------------------------------------------

def test_prefill_handoff_then_decode_elsewhere_continues_the_same_text(table):
    prompt = prompt_with_length(30, 45, seed=5)
    base = {"model": MODEL, "prompt": prompt, "seed": 5, "max_tokens": 300}
    so = {"include_usage": True, "continuous_usage_stats": True}

    async def go():
        async with running(table, "prefill", "p0") as pre, \
                running(table, "decode", "d0") as dec, \
                running(table, "decode", "d1") as dec2, aiohttp.ClientSession() as s:
            (st, whole), (_, first), (_, rest) = await asyncio.gather(
                post(s, dec.url, base),                          # one vPod does it all
                # 1. prefill on the prefill vPod: one token, and where its KV is
                post(s, pre.url, {**base, "max_tokens": 1,
                                  "kv_transfer_params": {"do_remote_decode": True}}),
                # fail-over: the KV is lost (only generated_tokens): recomputed here
                post(s, dec2.url, {**base, "kv_transfer_params": {"generated_tokens": 7}}))
            total = whole["usage"]["completion_tokens"]
            full = whole["choices"][0]["text"]
            assert st == 200 and whole["choices"][0]["finish_reason"] == "stop"
            assert first["usage"]["completion_tokens"] == 1
            assert first["choices"][0]["finish_reason"] == "length"
            kv = first["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] == "p0"
            assert kv["remote_port"] == pre.port and kv["kv_tokens"] == count_tokens(prompt)
            assert kv["kv_bytes"] == kv["kv_tokens"] * table.kv_bytes_per_token
            assert kv["dcn_bytes_per_s"] == V6E_DCN
            assert plan_output(prompt, max_tokens=300, seed=5).text(0, 7) + \
                rest["choices"][0]["text"] == full
            assert rest["usage"]["completion_tokens"] == total
            # 2. decode on a decode vPod, streamed; cut after 10 tokens (a migration)
            chunks, _ = await stream(s, dec.url, {
                **base, "stream_options": so,
                "kv_transfer_params": {**kv, "generated_tokens": 1}}, stop_after=10)
            k = chunks[-1]["usage"]["completion_tokens"]
            part1 = first["choices"][0]["text"] + text_of(chunks)
            assert k >= 10 and count_tokens(part1) == k
            # 3. the rest on another decode vPod, KV from d0: the text goes on seamlessly
            chunks, _ = await stream(s, dec2.url, {
                **base, "stream_options": so,
                "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "d0",
                                       "generated_tokens": k}})
            assert chunks[-1] == "[DONE]"
            assert part1 + text_of(chunks) == full
            assert chunks[-2]["usage"]["completion_tokens"] == total     # k + new
            assert [c for c in chunks[:-1] if c["choices"]][-1]["choices"][0][
                "finish_reason"] == "stop"

    run(go())


# ---- real time at the chip model's pace ------------------------------------------------------

def test_ttft_and_tpot_follow_the_chip_model(table):
    long_prompt = "word " * 4000
    P = count_tokens(long_prompt)
    prefill_s = table.step1(float(P), P * (P + 1) / 2, 0.0, 0.0)[0]
    n = 40
    short = "Tell me about the river"
    Ps = count_tokens(short)
    step_s = table.step1(0.0, 0.0, 1.0, float(Ps + n // 2))[0]
    slow_dcn = 2e9
    transfer_s = kv_transfer_s(Ps, table.kv_bytes_per_token, slow_dcn)

    async def go():
        async with running(table, "prefill", "p0") as pre, running(table) as dec, \
                aiohttp.ClientSession() as s:
            await post(s, pre.url, {"model": MODEL, "prompt": "warm up", "max_tokens": 1})
            # TTFT of a lone prefill: one step of the chip model (4000 tokens: ~0.11 s)
            t = time.perf_counter()
            st, r = await post(s, pre.url, {"model": MODEL, "prompt": long_prompt,
                                            "max_tokens": 1,
                                            "kv_transfer_params": {"do_remote_decode": True}})
            ttft = time.perf_counter() - t
            assert st == 200 and 0.95 * prefill_s < ttft < prefill_s + 0.1
            # decode: the KV transfer at the slower DCN (2 GB/s here), then one token a step
            t = time.perf_counter()
            chunks, times = await stream(s, dec.url, {
                "model": MODEL, "prompt": short, "max_tokens": n + 1, "ignore_eos": True,
                "stream_options": {"continuous_usage_stats": True},
                "kv_transfer_params": {"do_remote_prefill": True, "dcn_bytes_per_s": slow_dcn,
                                       "generated_tokens": 1}})
            counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
            assert counts[-1] == n + 1
            first_new = times[next(i for i, c in enumerate(counts) if c > 1)] - t
            assert transfer_s + step_s * 0.9 < first_new < transfer_s + step_s + 0.1
            decode_s = times[-1] - times[next(i for i, c in enumerate(counts) if c > 1)]
            # n tokens, the first one counted at its step's end: (n - 1) steps in between
            assert 0.85 * (n - 1) * step_s < decode_s < 1.15 * (n - 1) * step_s + 0.08
            # stream interval: chunks come a tick (20 ms) apart, each with every new token
            assert len(counts) <= n + 2
            assert max(b - a for a, b in zip(counts, counts[1:])) >= 1

    run(go())


def test_a_batch_shares_steps_and_pipeline_vpods_run_virtual_engines():
    pp_table = step_cost_table(ARCH, CAT, "v6e", "2x1", 1, 2, 1)

    async def go():
        async with running(pp_table, pp=2, max_batch=8) as srv, aiohttp.ClientSession() as s:
            assert len(srv._engines["decode"].engines) == 2
            t = time.perf_counter()
            res = await asyncio.gather(*(post(s, srv.url, {
                "model": MODEL, "prompt": f"request {i}", "max_tokens": 30,
                "ignore_eos": True}) for i in range(8)))
            wall = time.perf_counter() - t
            assert all(st == 200 and r["usage"]["completion_tokens"] == 30 for st, r in res)
            assert [r["choices"][0]["text"] for _, r in res] == [
                plan_output(f"request {i}", max_tokens=30, ignore_eos=True).full_text()
                for i in range(8)]
            # 8 requests batched (4 per virtual engine): ~30 steps, not 8 x 30
            step = pp_table.step1(0.0, 0.0, 4.0, 4 * 20.0)[0]
            assert wall < 30 * step * 2.5

    run(go())


# ---- metrics, cancellation, a crash ----------------------------------------------------------

def metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_metrics_count_requests_tokens_and_load(table):
    async def go():
        async with running(table) as srv, aiohttp.ClientSession() as s:
            for i in range(3):
                await post(s, srv.url, {"model": MODEL, "prompt": f"p{i} x", "max_tokens": 5,
                                        "ignore_eos": True})
            long = asyncio.ensure_future(post(s, srv.url, {
                "model": MODEL, "prompt": "long one", "max_tokens": 60, "ignore_eos": True}))
            await asyncio.sleep(0.2)
            async with s.get(srv.url + "/metrics") as r:
                busy = await r.text()
            await long
            async with s.get(srv.url + "/metrics") as r:
                idle = await r.text()
            assert metric(busy, "vllm:num_requests_running", model_name=MODEL) == 1
            assert metric(busy, "vllm:kv_cache_usage_perc") > 0
            assert metric(idle, "vllm:num_requests_running") == 0
            assert metric(idle, "vllm:num_requests_waiting") == 0
            assert metric(idle, "vllm:request_success_total", finished_reason="length") == 4
            assert metric(idle, "vllm:generation_tokens_total") == 3 * 5 + 60
            assert metric(idle, "vllm:prompt_tokens_total") == sum(
                count_tokens(p) for p in ("p0 x", "p1 x", "p2 x", "long one"))
            assert metric(idle, "vllm:time_to_first_token_seconds_count") == 4
            assert metric(idle, "vllm:e2e_request_latency_seconds_count") == 4
            assert metric(idle, "vllm:time_per_output_token_seconds_count") == 4
            assert metric(idle, "neuscale:energy_joules_total") > 0
            assert metric(idle, "vllm:gpu_cache_usage_perc") == 0

    run(go())


async def wait_for_abort(s: aiohttp.ClientSession, url: str, n: int = 1) -> str:
    """The /metrics text once ``n`` requests were counted aborted (polled every 10 ms)."""
    for _ in range(200):
        async with s.get(url + "/metrics") as r:
            text = await r.text()
        try:
            if metric(text, "vllm:request_success_total", finished_reason="abort") >= n:
                return text
        except KeyError:
            pass
        await asyncio.sleep(0.01)
    raise AssertionError("the abort was not counted")


def errors(caplog) -> list:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_that_goes_away_is_aborted_and_frees_its_slot(table, caplog):
    """One batch slot: a streamed request whose client goes away after 3 tokens is aborted in
    the engine at once (running count 0, its KV free), so the next request is admitted at once
    instead of waiting for the ~300 steps the first one had left. Quietly: a disconnect is
    normal."""
    step_s = table.step1(0.0, 0.0, 1.0, 100.0)[0]

    async def go():
        async with running(table, max_batch=1) as srv, aiohttp.ClientSession() as s:
            chunks, _ = await stream(s, srv.url, {
                "model": MODEL, "prompt": "go on", "max_tokens": 300, "ignore_eos": True,
                "stream_options": {"continuous_usage_stats": True}}, stop_after=3)
            assert chunks[-1] != "[DONE]"
            text = await wait_for_abort(s, srv.url)
            assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
            assert metric(text, "vllm:num_requests_running") == 0
            assert metric(text, "vllm:num_requests_waiting") == 0
            assert metric(text, "vllm:kv_cache_usage_perc") == 0
            ve = srv._engines["decode"]
            assert ve.idle and ve.loads == [0] and not srv._owner and not srv._active
            t = time.perf_counter()
            st, r = await post(s, srv.url, {"model": MODEL, "prompt": "next", "max_tokens": 4,
                                            "ignore_eos": True})
            wall = time.perf_counter() - t
            assert st == 200 and r["usage"]["completion_tokens"] == 4
            assert wall < 30 * step_s + 0.1 < 290 * step_s    # not behind the aborted one
            async with s.get(srv.url + "/metrics") as m:
                text = await m.text()
            assert metric(text, "vllm:request_success_total", finished_reason="length") == 1
            assert metric(text, "vllm:generation_tokens_total") == 4

    run(go())
    assert errors(caplog) == []


def test_prefill_and_queued_requests_are_aborted_too(table, caplog):
    """Clients that leave while their request waits for the decode slot, waits for the
    prefill engine, or is in its prefill step (the engines run a step whole: its decode is then
    already queued, arriving at the step's end) are taken out of the engines; the others go
    on."""
    long_prompt = "word " * 6000                 # ~0.19 s of prefill, one request a step

    async def go():
        async with running(table, max_batch=1) as srv, aiohttp.ClientSession() as s:
            first = asyncio.ensure_future(post(s, srv.url, {
                "model": MODEL, "prompt": "first", "max_tokens": 200, "ignore_eos": True}))
            await asyncio.sleep(0.05)
            queued = asyncio.ensure_future(post(s, srv.url, {
                "model": MODEL, "prompt": "second", "max_tokens": 5}))
            await asyncio.sleep(0.02)
            a = asyncio.ensure_future(post(s, srv.url, {
                "model": MODEL, "prompt": long_prompt, "max_tokens": 5}))
            await asyncio.sleep(0.02)
            b = asyncio.ensure_future(post(s, srv.url, {
                "model": MODEL, "prompt": "more " + long_prompt, "max_tokens": 5}))
            await asyncio.sleep(0.03)
            ve = srv._engines["decode"]
            pe = srv._engines["prefill"]
            assert ve.num_running == 1 and ve.num_waiting == 2    # second, and a's decode
            assert pe.num_waiting == 1                            # b
            for f in (queued, a, b):
                f.cancel()
            await wait_for_abort(s, srv.url, 3)
            assert (ve.num_running, ve.num_waiting) == (1, 0) and pe.idle
            st, r = await first
            assert st == 200 and r["usage"]["completion_tokens"] == 200
            assert ve.idle and pe.idle and not srv._owner and not srv._active

    run(go())
    assert errors(caplog) == []


def test_a_write_to_a_gone_client_is_handled_quietly(table, caplog, monkeypatch):
    """The connection breaks while a chunk is written (``ConnectionResetError``, before aiohttp
    has noticed the disconnect): the request is aborted, nothing is logged at ERROR."""
    from aiohttp import web
    real = web.StreamResponse.write
    writes = 0

    async def breaking(self, data):
        nonlocal writes
        writes += 1
        if writes == 3:
            raise ConnectionResetError("Cannot write to closing transport")
        return await real(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", breaking)

    async def go():
        async with running(table) as srv, aiohttp.ClientSession() as s:
            try:
                chunks, _ = await stream(s, srv.url, {
                    "model": MODEL, "prompt": "go on", "max_tokens": 300,
                    "ignore_eos": True})
                assert "[DONE]" not in chunks
            except aiohttp.ClientError:
                pass
            text = await wait_for_abort(s, srv.url)
            assert metric(text, "vllm:num_requests_running") == 0
            st, r = await post(s, srv.url, {"model": MODEL, "prompt": "next", "max_tokens": 3})
            assert st == 200 and r["usage"]["completion_tokens"] == 3

    run(go())
    assert writes >= 3 and errors(caplog) == []


def test_kill_resets_open_streams_and_closes_the_port(table):
    async def go():
        async with running(table) as srv, aiohttp.ClientSession() as s:
            async with s.post(srv.url + "/v1/completions", json={
                    "model": MODEL, "prompt": "a long story", "max_tokens": 500,
                    "ignore_eos": True, "stream": True}) as r:
                await r.content.readline()
                srv.kill()
                with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                                    aiohttp.ClientConnectionError)):
                    async for _ in r.content:
                        pass
            with pytest.raises(aiohttp.ClientConnectionError):
                async with s.get(srv.url + "/health") as r:
                    await r.read()

    run(go())
