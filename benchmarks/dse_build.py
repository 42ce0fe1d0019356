"""Cold and warm `orchestrator dse build` time per preset (all chips, both phases) and lookup cost.

Cold: an empty XLA-fit cache (every per-chip graph is lowered). Warm: the same cache again
(nothing lowered; JAX is not even imported). Each build runs as the CLI runs, in a subprocess.
Lookup: median time of BestFitDB.lookup against a baseline measured in the same run, a bare
``bisect`` over the 48 bucket edges (the floor any bucketed lookup pays).

    python benchmarks/dse_build.py [--models llama3-8b,deepseek-v3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from bisect import bisect_left
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed_build(model: str, cache: str, out: str, workers: int) -> tuple[float, dict]:
    env = dict(os.environ, NEUSCALE_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "dse", "build", "--model", model,
                        "--out", out, "--workers", str(workers), "--json"],
                       capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(p.stderr)
    return dt, json.loads(p.stdout)


def lookup_ns(db_path: str, n: int = 200_000) -> tuple[float, float]:
    from dse import BestFitDB
    db = BestFitDB.load(db_path)
    rng = random.Random(0)
    lens = [rng.randint(1, 1 << 20) for _ in range(n)]
    phases = ["prefill", "decode"] * (n // 2)
    edges = list(db.edges)

    def per_call(fn) -> float:
        samples = []
        for _ in range(7):
            t = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t) / n)
        return statistics.median(samples)

    def lookups():
        lk = db.lookup
        for ph, s in zip(phases, lens):
            lk(ph, s)

    def baseline():
        for s in lens:
            bisect_left(edges, s)

    return per_call(lookups), per_call(baseline)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama3-8b,llama3-70b,llama3.1-405b,deepseek-v3")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    print(f"{'model':15} {'cold s':>8} {'warm s':>8} {'cold/warm':>9} {'lookup ns':>10} "
          f"{'bisect ns':>10} {'ratio':>6}  fits  heldout-err")
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory() as d:
            out = str(Path(d) / "db.json")
            cold, info = timed_build(model, str(Path(d) / "cache"), out, args.workers)
            warm, _ = timed_build(model, str(Path(d) / "cache"), out, args.workers)
            lk, base = lookup_ns(out)
            fq = info["fit_quality"]
            print(f"{model:15} {cold:8.1f} {warm:8.1f} {cold / warm:9.1f} {lk:10.0f} {base:10.0f} "
                  f"{lk / base:6.1f}  {fq['fits']:4d}  {fq['heldout_max_rel_err']:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
