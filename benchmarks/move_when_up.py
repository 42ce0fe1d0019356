"""When make-before-break moves a bucket to its new group (commit d45460f), measured against
the rule as it was.

``as-shipped``: a bucket moves once every vPod its new group was ordered with is up (a ready
one and none starting). ``as-before`` (patched in for this run only): it moved at the new
group's first ready vPod - so a group re-chosen to an allocation that already ran one vPod
took the whole load of the group it replaced on that one vPod while the others started
(Llama3.1-405B on the Azure day, 16:50: 5,046 prompts queued, and the emergency rule then
grew the group to 298 vPods). Prints, per policy and variant, the row's efficiency and SLO
rate.

    python benchmarks/move_when_up.py                  # Llama3.1-405B Azure energy prefill, 15:00-18:00
    python benchmarks/move_when_up.py --row llama3-70b:lv-eval:energy:decode --start 12:00 --hours 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse.errors import NeuScaleError  # noqa: E402
from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.cluster import simulator  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from rows import check_rows, load_row  # noqa: E402


_SHIPPED = simulator.ClusterSim._route_tables


def _route_tables_before(self, now: float) -> None:
    """The routing step before the fix: a group with a ready vPod counts as up whatever of it
    still starts (the fleet reports no starting group to this step only)."""
    self.fleet.starting_groups = set
    try:
        _SHIPPED(self, now)
    finally:
        del self.fleet.starting_groups


def run(row: str, start: str, hours: float, before: bool, policy: str):
    r = load_row(row, start, hours)
    arr, inp, out = r.arrival_s, r.input_tokens, r.output_tokens
    if before:
        simulator.ClusterSim._route_tables = _route_tables_before
    try:
        cfg = ClusterConfig()
        res = ClusterSim(r.arch, r.db, make_policies(policy, r.db, cfg.policy, inp, out),
                         cfg).run(arr, inp, out)
    finally:
        simulator.ClusterSim._route_tables = _SHIPPED
    rep = res.reports[r.phase].to_json()
    return rep[r.key], rep["slo_rate"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="llama3.1-405b:azure-code:energy:prefill",
                    help="model:trace:metric:phase")
    ap.add_argument("--policies", default="neuscale,neuscale-paper")
    ap.add_argument("--start", default="15:00")
    ap.add_argument("--hours", type=float, default=3.0)
    args = ap.parse_args()
    check_rows(ap, [args.row], args.hours, "--row")
    pols = [p for p in args.policies.split(",") if p]
    print(f"| {args.row} ({args.hours:g} h from {args.start}) | as-before: efficiency | SLO | "
          "as-shipped: efficiency | SLO | shipped / before |")
    print("|---|---|---|---|---|---|")
    for pol in pols:
        try:
            e0, s0 = run(args.row, args.start, args.hours, True, pol)
            e1, s1 = run(args.row, args.start, args.hours, False, pol)
        except NeuScaleError as e:
            sys.exit(f"error: {e}")
        print(f"| {pol} | {e0:.4g} | {s0:.1%} | {e1:.4g} | {s1:.1%} | {e1 / e0:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
