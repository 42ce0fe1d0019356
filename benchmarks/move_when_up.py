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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.cluster import simulator  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from rows import before_after_main, load_row  # noqa: E402


_SHIPPED = simulator.ClusterSim._route_tables


def _route_tables_before(self, now: float) -> None:
    """The routing step before the fix: a group with a ready vPod counts as up whatever of it
    still starts (the fleet reports no starting group to this step only)."""
    self.fleet.starting_groups = set
    try:
        _SHIPPED(self, now)
    finally:
        del self.fleet.starting_groups


def run(row: str, start: str, hours: float, before: bool, policy: str, copies: int = 1):
    r = load_row(row, start, hours, copies)
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
    before_after_main(__doc__, run, "llama3.1-405b:azure-code:energy:prefill", "neuscale,neuscale-paper", "15:00", 3.0)


if __name__ == "__main__":
    main()
