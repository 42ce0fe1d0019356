"""How a PP decode vPod's virtual engines take a request - by projected batch slots (shipped)
or by the unfinished work counted since the simulator's last slice (before) - and what that
does to a row.

The cluster simulator advances its engines in 10-s slices, so an engine learns of finished
requests only at a slice's end. ``as-before`` (patched in for this run only): a decoding
request goes to the virtual engine with the least unfinished output tokens counted that way,
which within a busy slice is close to round-robin - a short answer lands on an engine whose
slots are full while another has one free. ``as-shipped``: to an engine with a slot free at
its arrival, else the one whose slot frees first, by the projected ends of what each engine
was given (:meth:`sim.vpod.VPodEngines._slot_at`) - the wait vLLM's one pool of running
requests gives (V1 schedules every micro-batch from it). Prints, per policy, the row's
efficiency and SLO rate under both (the SLO rate is where it shows: decode TPOTs of short
answers that waited for a slot).

    python benchmarks/decode_slots.py                       # DeepSeek-V3 Azure cost decode, 6 h
    python benchmarks/decode_slots.py --row llama3-70b:azure-code:energy:decode --hours 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.cluster import ClusterConfig, ClusterSim  # noqa: E402
from orchestrator.registry import make_policies  # noqa: E402
from rows import before_after_main, load_row  # noqa: E402
from sim import vpod  # noqa: E402

_shipped = vpod.VPodEngines.choose


def _choose_by_work(self, prompt: int, output: int, arrival_s: float | None = None) -> int:
    """The choice before: decode by the work counted since the last slice."""
    return _shipped(self, prompt, output, arrival_s if self._prefill else None)


def run(row: str, start: str, hours: float, before: bool, policy: str, copies: int = 1):
    r = load_row(row, start, hours, copies)
    arch, db = r.arch, r.db
    arr, inp, out = r.arrival_s, r.input_tokens, r.output_tokens
    if before:
        vpod.VPodEngines.choose = _choose_by_work
    try:
        cfg = ClusterConfig()
        res = ClusterSim(arch, db, make_policies(policy, db, cfg.policy, inp, out), cfg).run(
            arr, inp, out)
    finally:
        vpod.VPodEngines.choose = _shipped
    rep = res.reports[r.phase].to_json()
    return rep[r.key], rep["slo_rate"]


def main() -> None:
    before_after_main(__doc__, run, "deepseek-v3:azure-code:cost:decode", "neuscale,base",
                      "12:00", 6.0)


if __name__ == "__main__":
    main()
