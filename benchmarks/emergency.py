"""The emergency rule's two changes of commit 30a5276, measured apart against the rule as it was.

``as-shipped``: a group's queue is its aggregated one (its vPods' waiting requests and its
router queue, summed: §3.4's "peak aggregated queue size of each vPod group"), and an emergency
is planned at once between epochs, once per start-up (``EmergencyGate``). ``as-before`` (patched
in for this run only): a group's queue is the longest queue of one of its vPods, or its router
queue, and an emergency waits for the next epoch's plan, as the simulator did before.
``+between-epochs``: as before with plans between epochs; ``+aggregated``: as before with the
aggregated queue. Prints, per policy, each variant's efficiency and SLO rate, its efficiency
over ``as-before`` and how many emergency plans it made between epochs.

    python benchmarks/emergency.py                 # Llama3-70B Azure energy prefill, 12:00-14:00
    python benchmarks/emergency.py --row deepseek-v3:azure-code:energy:prefill
    python benchmarks/emergency.py --copies 64 --hours 0.25 --policies neuscale,base
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse.errors import NeuScaleError  # noqa: E402
from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.cluster import simulator  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from rows import load_row, row_args  # noqa: E402

VARIANTS = ("as-before", "+between-epochs", "+aggregated", "as-shipped")


def _sample_one_vpod(self) -> None:
    """The window's sample as before the change: each vPod's queue and the router queue noted
    on their own, so the window keeps the longest as the group's."""
    import numpy as np
    w, dt = self.window, self.dt
    w.record("prefill", self._cur_p / dt)
    w.record("decode", np.asarray(self._cur_d) / dt)
    self._cur_d = [0.0] * len(self.db.edges)
    for v in self.fleet.active:
        if v.engine is not None:
            w.note_queue(v.phase, v.group, v.engine.num_waiting)
    for (ph, g), lst in self._router_q.items():
        w.note_queue(ph, g, len(lst))


def run(row: str, start: str, hours: float, variant: str, policy: str, copies: int):
    r = load_row(row, start, hours, copies)
    arr, inp, out = r.arrival_s, r.input_tokens, r.output_tokens
    cfg = ClusterConfig()
    sim = ClusterSim(r.arch, r.db, make_policies(policy, r.db, cfg.policy, inp, out), cfg)
    if variant in ("as-before", "+between-epochs"):
        sim._sample = _sample_one_vpod.__get__(sim)
    if variant in ("as-before", "+aggregated"):
        sim._emergencies = lambda now: None
    res = sim.run(arr, inp, out)
    rep = res.reports[r.phase].to_json()
    return rep[r.key], rep["slo_rate"], sim.emergency_plans


def main() -> None:
    args, pols = row_args(__doc__, "llama3-70b:azure-code:energy:prefill",
                          "base,neuscale-paper,neuscale", "12:00", 2.0)
    x = f", {args.copies}x" if args.copies != 1 else ""
    print(f"| {args.row} ({args.hours:g} h from {args.start}{x}) | variant | efficiency | SLO "
          "| / as-before | emergency plans between epochs |")
    print("|---|---|---|---|---|---|")
    for pol in pols:
        base = None
        for variant in VARIANTS:
            try:
                e, slo, n = run(args.row, args.start, args.hours, variant, pol, args.copies)
            except NeuScaleError as err:
                sys.exit(f"error: {err}")
            base = base or e
            print(f"| {pol} | {variant} | {e:.4g} | {slo:.1%} | {e / base:.2f}x | {n} |",
                  flush=True)


if __name__ == "__main__":
    main()
