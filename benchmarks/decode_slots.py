"""Where a decoding request waits for a batch slot, and what the load-aware policy sizes a
decode group for: three variants of a row replayed side by side.

The cluster simulator advances its engines in 10-s slices, so an engine learns of finished
answers only at a slice's end.

* ``work`` (the tree before b5166f4, patched in for the run): a PP decode vPod's virtual
  engine chosen by the unfinished output tokens counted since the slice began, a group's vPod
  by its outstanding tokens counted the same way - within a busy slice both are close to
  round-robin, and a short answer lands on a full engine while another has a slot free; the
  policy sizes each vPod as its own queue (``LoadAwarePolicy.POOLED_DECODE = False``).
* ``slots`` (b5166f4): the virtual engine with a slot free at the arrival, else the one whose
  slot frees first, by the projected ends of what each engine was given
  (:meth:`sim.vpod.VPodEngines._slot_at`); vPods and sizing as ``work``.
* ``pooled`` (shipped): also a group's vPod with a slot free first
  (:func:`router.routing.free_slot_first` on :meth:`sim.vpod.VPodEngines.held_share`, the
  gateway's rule on its exact counts), and the policy sizes a group's vPods as one queue of
  all their slots (``POOLED_DECODE = True``).

Prints, per policy and variant, the row's efficiency and SLO rate and the ratio to ``work``.

    python benchmarks/decode_slots.py                       # DeepSeek-V3 Azure cost decode, 6 h
    python benchmarks/decode_slots.py --row llama3-70b:openthoughts:cost:decode --hours 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dse.errors import NeuScaleError  # noqa: E402
from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.cluster import simulator  # noqa: E402
from orchestrator.loadaware import LoadAwarePolicy  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from router.routing import least_loaded  # noqa: E402
from rows import load_row, row_args  # noqa: E402
from sim import vpod  # noqa: E402

VARIANTS = ("work", "slots", "pooled")
_shipped = (vpod.VPodEngines.choose, simulator.free_slot_first, LoadAwarePolicy.POOLED_DECODE)


def _choose_by_work(self, prompt: int, output: int, arrival_s: float | None = None) -> int:
    """A virtual engine as before b5166f4: decode by the work counted since the last slice."""
    return _shipped[0](self, prompt, output, arrival_s if self._prefill else None)


def _least_outstanding(vpods, held, load):
    """A group's vPod as before: the least outstanding tokens, slots not asked."""
    return least_loaded(vpods, load)


def run(row: str, start: str, hours: float, variant: str, policy: str, copies: int = 1):
    r = load_row(row, start, hours, copies)
    if variant in ("work", "slots"):
        simulator.free_slot_first = _least_outstanding
        LoadAwarePolicy.POOLED_DECODE = False
    if variant == "work":
        vpod.VPodEngines.choose = _choose_by_work
    try:
        cfg = ClusterConfig()
        res = ClusterSim(r.arch, r.db, make_policies(policy, r.db, cfg.policy, r.input_tokens,
                                                     r.output_tokens), cfg).run(
            r.arrival_s, r.input_tokens, r.output_tokens)
    finally:
        (vpod.VPodEngines.choose, simulator.free_slot_first,
         LoadAwarePolicy.POOLED_DECODE) = _shipped
    rep = res.reports[r.phase].to_json()
    return rep[r.key], rep["slo_rate"]


def main() -> None:
    args, pols = row_args(__doc__, "deepseek-v3:azure-code:cost:decode", "neuscale,base",
                          "12:00", 6.0)
    x = f", {args.copies}x" if args.copies != 1 else ""
    print(f"| {args.row} ({args.hours:g} h from {args.start}{x}) | "
          + " | ".join(f"{v}: efficiency | SLO" for v in VARIANTS)
          + " | slots / work | pooled / work |")
    print("|---|" + "---|---|" * len(VARIANTS) + "---|---|")
    for pol in pols:
        try:
            got = [run(args.row, args.start, args.hours, v, pol, args.copies) for v in VARIANTS]
        except NeuScaleError as e:
            sys.exit(f"error: {e}")
        print(f"| {pol} | " + " | ".join(f"{e:.4g} | {s:.1%}" for e, s in got)
              + f" | {got[1][0] / got[0][0]:.2f}x | {got[2][0] / got[0][0]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
