"""How much of the gap to Ideal-at-load is sizing headroom, and what dropping it costs in SLO.

Ideal-at-load (``orchestrator.cluster.accounting.ideal_at_load_report``) prices each 5-min
epoch at its *mean* token rate with ceil(rate / throughput) vPods: no queueing headroom, no
peak. This replays a row twice through the cluster simulator with the ``neuscale`` policy:

* ``as-is``: the policy as it ships (the load averaged over a stay, at most 5 % of the
  window's and of its last epoch's requests waiting past their slack:
  :func:`orchestrator.pricing.servers_for_window`);
* ``no-headroom``: the oracle's sizing put in the policy for this run only - every group
  ceil(the last epoch's mean demand) vPods, in its sizing and in the choice (no Erlang term,
  decode vPods allowed to run every slot busy, no window).

and prints, per variant, the row's efficiency as a fraction of Ideal-at-load and the SLO rate.
A variant that gets close to the oracle only by missing the SLO shows the oracle is not
reachable there; one that keeps the SLO shows headroom the policy did not need.

    python benchmarks/headroom.py                       # four rows, 2 h from 12:00
    python benchmarks/headroom.py --rows llama3-70b:openthoughts:energy:decode --hours 1
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse.errors import NeuScaleError  # noqa: E402
from orchestrator import loadaware, pricing  # noqa: E402
from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.cluster.accounting import ideal_at_load_report  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from rows import check_rows, load_row  # noqa: E402

ROWS = ("deepseek-v3:azure-code:energy:decode", "llama3-70b:openthoughts:energy:decode",
        "llama3-8b:lveval:cost:decode", "llama3-70b:lveval:energy:prefill")


def _ceil_mean(demand, *_args, recent: int = 0, **_kw) -> int:
    """ceil of the mean demand of the last ``recent`` samples (all of them without)."""
    a = np.asarray(demand, dtype=np.float64).ravel()
    a = a[-recent:] if 0 < recent < a.size else a
    m = float(a.mean()) if a.size else 0.0
    return 0 if m <= 0 else max(1, math.ceil(m - 1e-9))


def _without_headroom():
    """Put the oracle's sizing into the policy; returns what to restore."""
    saved = (pricing.servers_for_window, loadaware.servers_for_window)
    pricing.servers_for_window = loadaware.servers_for_window = _ceil_mean
    return saved


def _restore(saved) -> None:
    (pricing.servers_for_window, loadaware.servers_for_window) = saved


def measure(row: str, start: str, hours: float) -> list[tuple[float, float]]:
    """(efficiency / Ideal-at-load, SLO rate) of the row as shipped, then without headroom."""
    r = load_row(row, start, hours)
    arch, db, phase, key = r.arch, r.db, r.phase, r.key
    arr, inp, out = r.arrival_s, r.input_tokens, r.output_tokens
    cfg = ClusterConfig()
    ideal = None
    got = []
    for oracle_sizing in (False, True):
        saved = _without_headroom() if oracle_sizing else None
        try:
            pols = make_policies("neuscale", db, cfg.policy, inp, out)
            rep = ClusterSim(arch, db, pols, cfg).run(arr, inp, out).reports[phase].to_json()
        finally:
            if saved is not None:
                _restore(saved)
        if ideal is None:
            ideal = ideal_at_load_report(arch, db, arr, inp, out,
                                         pols[phase].pricer)[phase].to_json()[key]
        got.append((rep[key] / ideal, rep["slo_rate"]))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS),
                    help="comma-separated model:trace:metric:phase")
    ap.add_argument("--start", default="12:00")
    ap.add_argument("--hours", type=float, default=2.0)
    args = ap.parse_args()
    rows = args.rows.split(",")
    check_rows(ap, rows, args.hours)
    print(f"| row ({args.hours:g} h from {args.start}) | as-is: of Ideal-at-load | SLO | "
          "no headroom: of Ideal-at-load | SLO |")
    print("|---|---|---|---|---|")
    for row in rows:
        try:
            (f0, s0), (f1, s1) = measure(row, args.start, args.hours)
        except NeuScaleError as e:
            sys.exit(f"error: {row}: {e}")
        print(f"| {row} | {f0:.2f} | {s0:.1%} | {f1:.2f} | {s1:.1%} |", flush=True)


if __name__ == "__main__":
    main()
