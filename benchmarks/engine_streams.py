"""N concurrent streams against one simulated engine server: does its event loop stay
responsive, and do the streams come out right?

Starts ``python -m backends.sim.engine_server`` (llama3-8b, one v6e chip, decode vPod, 1024
sequences) as its own process, a /health probe as a third process (one request every 20 ms),
then opens N streaming completions at once from this process (``ignore_eos``, ``max_tokens``
tokens each). Prints the /health latency while the streams run (the baseline before them in
the same run), the time to finish all streams, chunks per stream and whether every stream
ended with [DONE], ``finish_reason`` "length" and the right usage. All three processes share
the machine's cores: read the latency as an upper bound.

    python benchmarks/engine_streams.py [--streams 1000] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import http.client, json, os, sys, time
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
out = []
while not os.path.exists(sys.argv[2]):
    t = time.perf_counter()
    c.request("GET", "/health"); r = c.getresponse(); r.read()
    out.append((time.time(), time.perf_counter() - t))
    time.sleep(0.02)
print(json.dumps(out))
"""


async def one(s, url, i, max_tokens):
    body = {"model": "llama3-8b", "prompt": f"Request {i} tells a story", "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    n, usage, finish, done = 0, None, None, False
    async with s.post(url + "/v1/completions", json=body) as r:
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
                finish = c["choices"][0]["finish_reason"] or finish
            usage = c.get("usage") or usage
    return done and finish == "length" and usage["completion_tokens"] == max_tokens, n


def pct(xs, q):
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))] * 1e3 if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=40)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    srv = subprocess.Popen([sys.executable, "-m", "backends.sim.engine_server", "--phase",
                            "decode", "--max-num-seqs", "1024", "--url-file", str(d / "url")],
                           env=env, stdout=subprocess.DEVNULL)
    try:
        while not (d / "url").exists():
            if srv.poll() is not None:
                sys.exit("the engine server did not start")
            time.sleep(0.05)
        url = (d / "url").read_text().strip()
        probe = subprocess.Popen([sys.executable, "-c", PROBE, url.rsplit(":", 1)[1],
                                  str(d / "stop")], stdout=subprocess.PIPE)

        async def load():
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                await asyncio.sleep(1.0)
                t0 = time.time()
                res = await asyncio.gather(*(one(s, url, i, a.max_tokens)
                                             for i in range(a.streams)))
                return t0, time.time(), res

        t0, t1, res = asyncio.run(load())
        (d / "stop").touch()
        lat = json.loads(probe.communicate()[0])
    finally:
        srv.terminate()
        srv.wait()
    before = [x for t, x in lat if t < t0]
    during = [x for t, x in lat if t0 <= t <= t1]
    print(f"{a.streams} streams x {a.max_tokens} tokens: all done in {t1 - t0:.2f} s, "
          f"{sum(ok for ok, _ in res)}/{a.streams} correct, "
          f"{statistics.mean(n for _, n in res):.1f} chunks per stream")
    for name, xs in (("idle", before), ("under load", during)):
        print(f"/health {name:>10}: n={len(xs):3d} median {pct(xs, 0.5):6.1f} ms  "
              f"p95 {pct(xs, 0.95):6.1f} ms  max {pct(xs, 1.0):6.1f} ms")


if __name__ == "__main__":
    main()
