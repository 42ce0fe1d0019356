"""What the order of a slice's prefill hand-offs and the virtual-engine choice of a PP vPod do to
a row (the simulator fix of commit 835d58d), measured against the simulator as it was.

The cluster simulator advances its engines in 10-s slices, so an engine learns of finished
requests only at a slice's end. ``as-shipped``: a slice's hand-offs reach decode sorted by
arrival and a PP vPod's virtual engines take a request as :meth:`sim.vpod.VPodEngines.choose`
does now (decode: by projected batch slots since ``benchmarks/decode_slots.py``; by the
unfinished work they hold when this benchmark was written).
``as-before`` (patched in for this run only): hand-offs given prefill vPod after prefill vPod,
virtual engines chosen by their count of unfinished requests. Prints, per policy and variant,
the row's efficiency and SLO rate (the SLO rate is where the artefact shows: answers that wait
for a virtual engine another answer holds).

    python benchmarks/handoff_order.py                                   # DeepSeek-V3, 6 h
    python benchmarks/handoff_order.py --row llama3-70b:azure-code:energy:prefill --hours 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.cluster import simulator  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from rows import before_after_main, load_row  # noqa: E402
from sim import vpod  # noqa: E402


def _advance_unsorted(self, t_next: float) -> None:
    """The simulator's slice before the fix: hand-offs submitted as each prefill vPod's
    finished requests are read."""
    active = self.fleet.active
    for v in active:
        if v.engine is not None and v.phase == "prefill":
            handoffs: list = []
            self._prefill_done(v, v.engine.advance_to(t_next), handoffs)
            for g, r, at_s, inp, out in handoffs:
                self._submit("decode", g, r, at_s, inp, out)
    for v in active:
        if v.engine is not None and v.phase == "decode":
            self._decode_done(v, v.engine.advance_to(t_next))


def _choose_by_count(self, prompt: int, output: int, arrival_s: float | None = None) -> int:
    loads = self.loads
    return loads.index(min(loads))


def run(row: str, start: str, hours: float, before: bool, policy: str, copies: int = 1):
    r = load_row(row, start, hours, copies)
    arch, db = r.arch, r.db
    arr, inp, out = r.arrival_s, r.input_tokens, r.output_tokens
    saved = (simulator.ClusterSim._advance_engines, vpod.VPodEngines.choose)
    if before:
        simulator.ClusterSim._advance_engines = _advance_unsorted
        vpod.VPodEngines.choose = _choose_by_count
    try:
        cfg = ClusterConfig()
        res = ClusterSim(arch, db, make_policies(policy, db, cfg.policy, inp, out), cfg).run(
            arr, inp, out)
    finally:
        simulator.ClusterSim._advance_engines, vpod.VPodEngines.choose = saved
    rep = res.reports[r.phase].to_json()
    return rep[r.key], rep["slo_rate"]


def main() -> None:
    before_after_main(__doc__, run, "deepseek-v3:azure-code:cost:decode", "neuscale,base", "00:00", 6.0)


if __name__ == "__main__":
    main()
