"""How much a row of the results table moves with the simulator's random stream alone.

The cluster simulator draws from one random stream (``ClusterConfig.seed``): which requests'
output lengths are predicted right, the controller's statistics-query delay, each vPod's
creation time (Table 3's ranges). A change to the code that makes one more or one fewer draw
shifts everything after it, so a row can move with no change to what it measures. This replays
rows with several seeds and prints, per policy, the efficiency and SLO rate of each seed, and
the spread: (max - min) / median of the efficiency, and of NeuScale / Base - the noise floor a
change to a row in the table has to clear before it means anything.

    python benchmarks/seed_noise.py                               # three rows, 2 h from 12:00
    python benchmarks/seed_noise.py --rows llama3-70b:azure-code:cost:prefill --seeds 0,1,2,3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse.errors import NeuScaleError  # noqa: E402
from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from rows import check_rows, load_row  # noqa: E402

ROWS = ("llama3-70b:azure-code:cost:prefill", "deepseek-v3:azure-code:cost:decode",
        "llama3-8b:openthoughts:energy:decode")
POLICIES = ("neuscale", "base")


def measure(row: str, start: str, hours: float, seeds: list[int]) -> dict[str, list]:
    """Per policy, (efficiency, SLO rate) of the row for each seed."""
    r = load_row(row, start, hours)
    arch, db, phase, key = r.arch, r.db, r.phase, r.key
    arr, inp, out = r.arrival_s, r.input_tokens, r.output_tokens
    got: dict[str, list] = {p: [] for p in POLICIES}
    for seed in seeds:
        cfg = ClusterConfig(seed=seed)
        for name in POLICIES:
            pols = make_policies(name, db, cfg.policy, inp, out)
            rep = ClusterSim(arch, db, pols, cfg).run(arr, inp, out).reports[phase].to_json()
            got[name].append((rep[key], rep["slo_rate"]))
    return got


def spread(x) -> float:
    x = np.asarray(x, dtype=float)
    return float((x.max() - x.min()) / np.median(x)) if len(x) and np.median(x) > 0 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS),
                    help="comma-separated model:trace:metric:phase")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated simulator seeds")
    ap.add_argument("--start", default="12:00")
    ap.add_argument("--hours", type=float, default=2.0)
    args = ap.parse_args()
    rows = args.rows.split(",")
    check_rows(ap, rows, args.hours)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds: {args.seeds!r} is not a comma-separated list of integers")
    if len(seeds) < 2:
        ap.error("--seeds: give at least two seeds")
    print(f"| row ({args.hours:g} h from {args.start}) | policy | efficiency per seed | "
          "spread | SLO per seed |")
    print("|---|---|---|---|---|")
    for row in rows:
        try:
            got = measure(row, args.start, args.hours, seeds)
        except NeuScaleError as e:
            sys.exit(f"error: {row}: {e}")
        for name in POLICIES:
            eff = [e for e, _ in got[name]]
            slo = " / ".join(f"{s:.1%}" for _, s in got[name])
            print(f"| {row} | {name} | {' / '.join(f'{e:.4g}' for e in eff)} | "
                  f"{spread(eff):.1%} | {slo} |", flush=True)
        ratio = [a / b for (a, _), (b, _) in zip(got["neuscale"], got["base"]) if b > 0]
        print(f"| {row} | neuscale / base | {' / '.join(f'{r:.2f}x' for r in ratio)} | "
              f"{spread(ratio):.1%} | |", flush=True)


if __name__ == "__main__":
    main()
