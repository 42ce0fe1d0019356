"""A scale-in during a hand-off, held until the taker is up (make before break for vPods), measured
against the drivers as they were.

``as-shipped``: a plan that moves buckets from a running group to one still starting and
deletes vPods of the running group in the same epoch keeps those vPods serving until the
hand-off is done (``router.routing.handing_over``). ``as-before`` (patched in for this run
only): only an *evicted* group's vPods waited; a group that kept some buckets was scaled in at
once, so the buckets it still served while the taker started ran on what was left
(DeepSeek-V3 decode at 4x the Azure window, 12:10: the old group went 7 -> 4 vPods while a
v5p-128 vPod started for its short buckets; 20-35 % of TPOTs missed for three minutes).
Prints, per policy and variant, the row's efficiency and SLO rate.

    python benchmarks/hold_scale_in.py        # DeepSeek-V3 Azure energy decode, 12:00-12:15, 4 copies (~1 min)
    python benchmarks/hold_scale_in.py --row llama3.1-405b:azure-code:energy:prefill --start 15:00 --hours 3 --copies 1
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.cluster import simulator  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from rows import before_after_main, load_row  # noqa: E402

_SHIPPED = simulator.handing_over


def _evicted_only(routing, planned):
    """The hold before the fix: only a group the plan no longer has waits (while something
    still routes to it)."""
    if routing is None or planned is None:
        return set()
    return set(routing.groups) - set(planned.groups)


def run(row: str, start: str, hours: float, before: bool, policy: str, copies: int = 1):
    r = load_row(row, start, hours, copies)
    arr, inp, out = r.arrival_s, r.input_tokens, r.output_tokens
    if before:
        simulator.handing_over = _evicted_only
    try:
        cfg = ClusterConfig()
        res = ClusterSim(r.arch, r.db, make_policies(policy, r.db, cfg.policy, inp, out),
                         cfg).run(arr, inp, out)
    finally:
        simulator.handing_over = _SHIPPED
    rep = res.reports[r.phase].to_json()
    return rep[r.key], rep["slo_rate"]


def main() -> None:
    before_after_main(__doc__, run, "deepseek-v3:azure-code:energy:decode", "neuscale",
                      "12:00", 0.25, copies=4)


if __name__ == "__main__":
    main()
