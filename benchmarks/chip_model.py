"""Speed of the detailed chip model, the tabulated step-cost model and the engine's fast mode.

Prints steps per second of each, with the detailed model as the baseline measured in the same
run, and the table's error against it. Noisy shared machine: read the ratios, not the absolutes.

    python benchmarks/chip_model.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse import default_catalog, load_model  # noqa: E402
from dse.costmodel import Parallelism  # noqa: E402
from sim.chip import ChipModel  # noqa: E402
from sim.engine import Engine  # noqa: E402
from sim.stepcost import StepCostTable  # noqa: E402

CASES = [("llama3-8b", "v6e", "1x1", Parallelism(1)),
         ("llama3-70b", "v5p", "2x2x2", Parallelism(8)),
         ("deepseek-v3", "v5p", "4x4x2", Parallelism(4, 1, 8))]


def main() -> None:
    cat = default_catalog()
    rng = np.random.default_rng(0)
    print(f"{'allocation':34} {'detailed st/s':>13} {'table st/s':>12} {'ratio':>8} "
          f"{'build s':>8} {'max err':>8} {'engine fast/exact':>18}")
    for m, c, t, par in CASES:
        cm = ChipModel.of(load_model(m), cat, c, t, par.tp, par.pp, par.ep)
        n = 300
        nd = rng.integers(1, 256, n)
        kv = nd * rng.integers(128, 8192, n)
        t0 = time.perf_counter()
        for i in range(n):
            cm.mixed_step(0, 0, int(nd[i]), float(kv[i]))
        det = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        tab = StepCostTable(cm)
        build = time.perf_counter() - t0
        N = 200_000
        ndv = rng.integers(1, 256, N)
        kvv = ndv * rng.integers(128, 8192, N)
        t0 = time.perf_counter()
        tab.step(0, 0, ndv, kvv)
        fast = N / (time.perf_counter() - t0)
        err = tab.fit_error(100)["latency_max_rel_err"]
        rates = []
        for exact in (False, True):
            e = Engine(tab, max_batch=128, exact=exact)
            for i in range(300):
                e.submit(i, i * 0.02, 1000, 300)
            t0 = time.perf_counter()
            e.run_until_idle()
            rates.append(e.stats().steps / (time.perf_counter() - t0))
        print(f"{m + ' ' + c + ':' + t + ' ' + str(par):34} {det:13,.0f} {fast:12,.0f} "
              f"{fast / det:8.0f} {build:8.2f} {err:8.2%} {rates[0] / rates[1]:17.1f}x",
              flush=True)


if __name__ == "__main__":
    main()
