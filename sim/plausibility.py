"""The simulated engine against public TPU serving measurements.

``tests/data/public_measurements.csv`` holds published figures, one row per (setup, metric),
in the input format of ``orchestrator sim bench --from-csv`` (model, chip, topology, tp, pp, ep,
stack, max_num_seqs, max_batched_tokens, chunked_prefill, workload, requests, input_tokens,
output_tokens) plus ``metric`` (a result column of the bench), ``measured``, ``known_gap`` (why
a row is not reproduced, when it is not), ``assumptions`` and ``source``. :func:`evaluate` runs
the row's workload on the simulated engine (:mod:`sim.bench`) and reports model / measured.

Several rows calibrate a serving-stack constant (:mod:`dse.stacks` says which); the others are
held out. ``python -m sim.plausibility`` prints the table the README shows.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from dse.errors import NeuScaleError

DEFAULT_CSV = Path(__file__).resolve().parents[1] / "tests" / "data" / "public_measurements.csv"
TOLERANCE = 0.30        # +-30 %: the bar for throughput, TTFT and TPOT


def load(path: str | Path = DEFAULT_CSV) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def evaluate(row: dict[str, str], cache: dict | None = None) -> dict[str, Any]:
    """Run the row's workload; model value, measured value and their ratio. ``cache`` (a
    dict) shares one run among the rows of the same setup."""
    from .bench import RESULT_COLUMNS, bench_config, run
    metric = row["metric"]
    if metric not in RESULT_COLUMNS:
        raise NeuScaleError(f"row {row.get('id')!r}: metric {metric!r} is not a bench result "
                            f"({', '.join(RESULT_COLUMNS)})")
    cfg = bench_config(row.get)
    key = repr(cfg)
    res = cache.get(key) if cache is not None else None
    if res is None:
        res = run(cfg)
        if cache is not None:
            cache[key] = res
    value, measured = float(res[metric]), float(row["measured"])
    ratio = value / measured
    return {"id": row["id"], "metric": metric, "model_value": value, "measured": measured,
            "model_over_measured": ratio, "within_tolerance": abs(ratio - 1) <= TOLERANCE,
            "known_gap": row.get("known_gap", ""), "source": row["source"]}


if __name__ == "__main__":  # pragma: no cover - the README's table
    import sys
    cache: dict = {}
    for row in load(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_CSV):
        r = evaluate(row, cache)
        print(f"{r['id']:34} {r['metric']:17} model {r['model_value']:10.4g}  measured "
              f"{r['measured']:10.4g}  model/measured {r['model_over_measured']:.2f}"
              + ("  (known gap)" if r["known_gap"] else ""))
