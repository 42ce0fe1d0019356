"""1000 concurrent streams against one simulated engine server (a process of its own, as in the
sim cloud) must not starve its event loop: a probe in a third process sees /health answered
quickly throughout, and every stream completes with the right tokens, usage and finish
reason."""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp

from dse.tokens import count_tokens

ROOT = Path(__file__).resolve().parents[2]
N = 1000
MAX_TOKENS = 40

PROBE = textwrap.dedent("""
    import http.client, json, os, sys, time
    host, port, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    c = http.client.HTTPConnection(host, port, timeout=30)
    out, end = [], time.time() + 60
    while time.time() < end and not os.path.exists(stop):
        t = time.perf_counter()
        c.request("GET", "/health"); r = c.getresponse(); r.read()
        out.append((time.time(), time.perf_counter() - t))
        time.sleep(0.02)
    print(json.dumps(out))
""")


async def one(s: aiohttp.ClientSession, url: str, i: int):
    body = {"model": "llama3-8b", "prompt": f"Request {i} tells a story", "stream": True,
            "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    text, usage, finish, n, done = [], None, None, 0, False
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if not line.startswith(b"data:"):
                continue
            p = line[5:].strip()
            if p == b"[DONE]":
                done = True
                break
            c = json.loads(p)
            n += 1
            if c["choices"]:
                text.append(c["choices"][0]["text"])
                finish = c["choices"][0]["finish_reason"] or finish
            usage = c.get("usage") or usage
    return done, "".join(text), usage, finish, n


def test_1000_streams_do_not_starve_the_loop(tmp_path):
    url_file = tmp_path / "url"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    srv = subprocess.Popen([sys.executable, "-m", "backends.sim.engine_server", "--phase",
                            "decode", "--max-num-seqs", "1024", "--url-file", str(url_file)],
                           env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not url_file.exists():
            assert srv.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        url = url_file.read_text().strip()
        port = url.rsplit(":", 1)[1]
        stop = tmp_path / "stop"
        probe = subprocess.Popen([sys.executable, "-c", PROBE, "127.0.0.1", port, str(stop)],
                                 stdout=subprocess.PIPE)

        async def load():
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn,
                                             timeout=aiohttp.ClientTimeout(total=60)) as s:
                await asyncio.sleep(0.5)            # the probe's baseline
                t0 = time.time()
                res = await asyncio.gather(*(one(s, url, i) for i in range(N)))
                return t0, time.time(), res

        t0, t1, res = asyncio.run(load())
        stop.touch()
        out, _ = probe.communicate(timeout=60)
    finally:
        srv.terminate()
        assert srv.wait(10) == 0                     # SIGTERM: a clean exit
    for done, text, usage, finish, n in res:
        assert done and finish == "length"
        assert usage == {"prompt_tokens": usage["prompt_tokens"],
                         "completion_tokens": MAX_TOKENS,
                         "total_tokens": usage["prompt_tokens"] + MAX_TOKENS}
        assert count_tokens(text) == MAX_TOKENS
        assert n <= MAX_TOKENS + 1                   # never more than a chunk per token
    lat = sorted(dt for t, dt in json.loads(out) if t0 <= t <= t1)
    assert len(lat) >= 10, "the probe did not run during the load"
    p95 = lat[int(0.95 * (len(lat) - 1))]
    print(f"\n{N} streams in {t1 - t0:.2f} s; /health under load: n={len(lat)} median "
          f"{statistics.median(lat) * 1e3:.1f} ms, p95 {p95 * 1e3:.1f} ms, max "
          f"{lat[-1] * 1e3:.1f} ms; chunks per stream {statistics.mean(r[4] for r in res):.1f}")
    assert statistics.median(lat) < 0.05
    assert p95 < 0.1
