"""The chip model and engine against public TPU serving measurements.

``tests/data/public_measurements.csv`` lists published figures (with sources and the
assumptions needed to reproduce their workloads); :func:`evaluate` recomputes each with the
detailed chip model (single steps) or the simulated engine on the tabulated step cost, and
reports model / measured.

Methods: ``decode_step`` - one decode iteration of ``concurrency`` sequences at KV length
``input_tokens``, throughput = batch / TPOT; ``engine_offline`` - ``requests`` requests queued at
t = 0 on a mixed engine, throughput = requests / makespan; ``engine_closed_loop`` -
``concurrency`` clients each sending its next request when the previous one finishes (lengths
0.5x-1.5x the means), mean TTFT and TPOT over the requests after the first ``concurrency``
(the synchronised start is a warm-up).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from dse.catalog import default_catalog
from dse.models import load_model

from .chip import ChipModel
from .engine import Engine
from .stepcost import StepCostTable


def load(path: str | Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _engine(row: dict[str, str], cm: ChipModel, max_batch: int) -> Engine:
    return Engine(StepCostTable(cm), mode="mixed", max_batch=max_batch, max_batched_tokens=8192)


def closed_loop(engine: Engine, clients: int, requests: int, prompt: int, output: int,
                seed: int = 0) -> None:
    """``clients`` users, each submitting its next request when its previous one finishes.
    Lengths are drawn uniformly from 0.5x-1.5x the means (as serving benchmarks' random
    datasets do), so clients drift apart instead of arriving in lock-step waves."""
    import numpy as np
    rng = np.random.default_rng(seed)

    def submit(i: int, t: float) -> None:
        engine.submit(i, t, max(1, int(prompt * rng.uniform(0.5, 1.5))),
                      max(2, int(output * rng.uniform(0.5, 1.5))))

    sent = 0
    for _ in range(min(clients, requests)):
        submit(sent, 0.0)
        sent += 1
    while not engine.idle or sent < requests:
        t = engine.next_event_time()
        if t is None:
            break
        for _ in engine.advance_to(t):
            if sent < requests:
                submit(sent, engine.now_s)
                sent += 1


def evaluate(row: dict[str, str]) -> dict[str, Any]:
    cm = ChipModel.of(load_model(row["model"]), default_catalog(), row["chip"], row["topology"],
                      int(row["tp"]))
    conc, n_in, n_out = int(row["concurrency"]), int(row["input_tokens"]), int(row["output_tokens"])
    n_req = int(row["requests"] or 0)
    method, metric = row["method"], row["metric"]
    if method == "decode_step":
        r = cm.step("decode", conc, n_in)
        value = conc / r.latency_s
    elif method == "engine_offline":
        e = _engine(row, cm, conc)
        for i in range(n_req):
            e.submit(i, 0.0, n_in, n_out)
        e.run_until_idle()
        value = n_req / e.stats().now_s
    elif method == "engine_closed_loop":
        e = _engine(row, cm, max(conc, 1))
        closed_loop(e, conc, n_req, n_in, n_out)
        done = [r for r in e.finished if r.req_id >= conc]     # skip the warm-up wave
        key = "ttft_s" if metric == "ttft_s" else "tpot_s"
        vals = [getattr(r, key) for r in done if getattr(r, key) is not None]
        value = sum(vals) / len(vals)
    else:
        raise ValueError(f"unknown method {method!r}")
    lo, hi = float(row["measured_low"]), float(row["measured_high"])
    return {"id": row["id"], "metric": metric, "model_value": value, "measured_low": lo,
            "measured_high": hi, "model_over_measured": value / (lo if value < lo else
                                                                 hi if value > hi else value),
            "within_range": lo <= value <= hi, "source": row["source"]}


if __name__ == "__main__":  # pragma: no cover - report for the README / issue notes
    import sys
    for row in load(sys.argv[1] if len(sys.argv) > 1 else
                    Path(__file__).resolve().parents[1] / "tests/data/public_measurements.csv"):
        r = evaluate(row)
        print(f"{r['id']:26} {r['metric']:22} model {r['model_value']:10.4g}  measured "
              f"{r['measured_low']:g}-{r['measured_high']:g}  model/measured "
              f"{r['model_over_measured']:.2f}")
