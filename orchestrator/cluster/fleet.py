"""The cluster simulator's vPods: each a set of simulated engines on its allocation's step-cost
table, with the life cycle of paper Table 3 (created, starting, ready, draining, released).

A :class:`Fleet` holds every vPod of a run. It creates them from the policy's actions (their
start-up drawn from :mod:`sim.lifecycle`), moves them along their life cycle as virtual time
passes, keeps the index of ready vPods per (phase, group) the router reads, and prices them:
static power from creation, the engines' energy once ready, dollars for every chip-second held.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dse.catalog import Catalog
from dse.costmodel import Parallelism, max_weights_bytes
from dse.models import ModelArch
from dse.vpod import VPodState
from sim.lifecycle import DELETE_S, kv_transfer_s, startup
from sim.vpod import VPodEngines, vpod_engines

Alloc = tuple[str, str, int, int, int, str]   # chip, topology, tp, pp, ep, attn


@dataclass
class SimVPod:
    """One simulated vPod and where it is in its life cycle."""
    id: str
    group: str
    phase: str
    chip: str
    topology: str
    num_chips: int
    alloc: Alloc
    max_batch: int
    throughput_tok_per_s: float
    created_s: float
    ready_s: float
    failover: bool = False
    state: VPodState = VPodState.STARTING
    engine: VPodEngines | None = None
    outstanding: float = 0.0           # tokens routed to it and not finished (router's load)
    released_s: float | None = None
    drain_from_s: float | None = None
    dcn_bytes_per_s: float = 1.0       # the vPod's DCN bandwidth (all its chips)
    delete_at_s: float | None = None   # the plan that deletes it takes effect then

    def kv_transfer_s(self, tokens: int, kv_bytes_per_token: float) -> float:
        return kv_transfer_s(tokens, kv_bytes_per_token, self.dcn_bytes_per_s)


def load(v: SimVPod) -> float:
    """The router's load measure inside a group: outstanding tokens over throughput."""
    return v.outstanding / v.throughput_tok_per_s


def prefill_key(v: SimVPod, at_s: float) -> tuple[float, float, float]:
    """What the simulator's prefill router compares at an arrival: how long until the vPod
    can start a prompt, the work its engines hold (:meth:`sim.vpod.VPodEngines.backlog_s`),
    then its outstanding tokens (:func:`load`); the smallest wins, ties to the first."""
    wait_s, work_s = v.engine.backlog_s(at_s)
    return wait_s, work_s, load(v)


def soonest(vpods: list[SimVPod], at_s: float) -> SimVPod:
    """The vPod of ``vpods`` with the smallest :func:`prefill_key` at ``at_s`` (ties: the
    first) - ``min(vpods, key=...)``'s answer, without asking every vPod. A vPod whose engines
    are all busy waits until the soonest is free (pipelined: and its first stage; either kept
    between submits, :meth:`sim.vpod.VPodEngines.soonest_start`), one with an idle engine at
    least 0, so vPods are asked in the order of that bound until it passes the best wait. A
    pool of ~90 pipelined vPods (Llama3-70B prefill at 64x the Azure load) asked each of
    them at every arrival: 92 % of that run's time."""
    n = len(vpods)
    if n < 3:
        return min(vpods, key=lambda v: prefill_key(v, at_s))
    bound = []
    for v in vpods:          # the wait itself while every engine is busy, else below 0
        m, first, _ = v.engine.soonest_start()
        bound.append((first if at_s <= m else m) - at_s)
    best_key, best_i = None, -1
    for i in sorted(range(n), key=bound.__getitem__):
        if best_key is not None and bound[i] > best_key[0]:
            break                      # this and every later vPod waits longer than the best
        v = vpods[i]
        w = v.engine.wait_s(at_s)
        if best_key is not None and w > best_key[0]:
            continue                   # its work and load cannot make up for the wait
        k = (w, v.engine.work_s(at_s), load(v))
        if best_key is None or k < best_key or (k == best_key and i < best_i):
            best_key, best_i = k, i
    return vpods[best_i]


class Fleet:
    """Every vPod of one simulated run (both phases)."""

    def __init__(self, arch: ModelArch, catalog: Catalog, rng: np.random.Generator,
                 table_for, max_batched_tokens: int):
        self.arch, self.catalog, self.rng = arch, catalog, rng
        self._table_for = table_for              # alloc -> StepCostTable
        self.max_batched_tokens = max_batched_tokens
        self.vpods: dict[str, SimVPod] = {}
        self.active: list[SimVPod] = []           # not released yet
        self.ready_by: dict[tuple[str, str], list[SimVPod]] = {}
        self.released_energy_j = {"prefill": 0.0, "decode": 0.0}
        self._n = 0

    # ---- life cycle ---------------------------------------------------------------------------
    def create(self, phase: str, group: str, chip: str, topology: str, par: Parallelism,
               max_batch: int, throughput_tok_per_s: float, now_s: float,
               failover: bool = False) -> SimVPod:
        """Order a vPod at ``now_s``; it is ready after its Table 3 start-up."""
        c = self.catalog.get(chip)
        ready_s = now_s + startup(c, max_weights_bytes(self.arch, par), self.rng).total_s
        self._n += 1
        vid = f"{phase[0]}{self._n}"
        v = SimVPod(vid, group, phase, chip, topology, par.chips,
                    (chip, topology, par.tp, par.pp, par.ep, par.attn), max_batch,
                    max(throughput_tok_per_s, 1e-9), now_s, ready_s, failover,
                    dcn_bytes_per_s=c.dcn_bw_bytes_per_s * par.chips)
        self.vpods[vid] = v
        self.active.append(v)
        return v

    def release(self, v: SimVPod, at_s: float) -> None:
        """Stop routing to ``v`` from ``at_s`` on (the slice that holds it); it drains and is
        deleted 15 s after its last request."""
        if v.state in (VPodState.DRAINING, VPodState.RELEASED) or v.delete_at_s is not None:
            return
        v.delete_at_s = at_s

    def advance(self, t_next: float) -> None:
        """Life-cycle transitions that happen before ``t_next``: deletions take effect
        (draining), start-ups finish (engines come up), drained vPods are released."""
        for v in self.active:
            if v.delete_at_s is not None and v.delete_at_s < t_next and \
                    v.state in (VPodState.STARTING, VPodState.READY):
                v.state = VPodState.DRAINING
                v.drain_from_s = v.delete_at_s
            if v.state == VPodState.STARTING and v.ready_s < t_next:
                self._start_engines(v)
            if v.state == VPodState.DRAINING and (v.engine is None or v.engine.idle):
                v.state = VPodState.RELEASED
                v.released_s = max(v.drain_from_s or 0.0,
                                   v.engine.now_s if v.engine else 0.0) + DELETE_S
                self.released_energy_j[v.phase] += self.energy_j(v, v.released_s)
        self.index_ready()

    def _start_engines(self, v: SimVPod) -> None:
        v.state = VPodState.READY
        v.engine = vpod_engines(self._table_for(v.alloc), v.phase, v.max_batch, v.alloc[3],
                                self.max_batched_tokens, v.ready_s)

    def index_ready(self) -> None:
        """Ready vPods per (phase, group) and the vPods not yet released; rebuilt whenever a
        vPod changes state (once per slice and after each epoch), not scanned per request."""
        idx: dict[tuple[str, str], list[SimVPod]] = {}
        active = []
        for v in self.active:
            if v.state == VPodState.READY:
                idx.setdefault((v.phase, v.group), []).append(v)
            if v.state != VPodState.RELEASED:
                active.append(v)
        self.ready_by = idx
        self.active = active

    def starting_groups(self) -> set[tuple[str, str]]:
        return {(v.phase, v.group) for v in self.active if v.state == VPodState.STARTING}

    def chips_held(self) -> list[tuple[str, int]]:
        """(chip, chips) of every vPod not released: what counts against the quotas."""
        return [(v.chip, v.num_chips) for v in self.active]

    # ---- accounting ---------------------------------------------------------------------------
    def energy_j(self, v: SimVPod, stop_s: float) -> float:
        """Energy of a vPod from creation to ``stop_s``: static power while it starts up, its
        engines (steps, and static power while idle) after."""
        e = self._startup_energy_j(v, stop_s)
        if v.engine is not None:
            v.engine.advance_to(stop_s)
            e += v.engine.energy_j()
        return e

    def _startup_energy_j(self, v: SimVPod, until_s: float) -> float:
        c = self.catalog.get(v.chip)
        return c.static_power_w * v.num_chips * max(0.0, min(v.ready_s, until_s) - v.created_s)

    def phase_energy_j(self, phase: str, t_s: float) -> float:
        """Energy used by ``phase``'s vPods so far: released ones in full, the others up to
        ``t_s`` (start-up) or their engines' clocks."""
        energy = self.released_energy_j[phase]
        for v in self.active:
            if v.phase != phase:
                continue
            energy += self._startup_energy_j(v, t_s)
            if v.engine is not None:
                energy += v.engine.energy_j()
        return energy

    def ready_per_group(self, phase: str) -> dict[str, int]:
        groups: dict[str, int] = {}
        for v in self.active:
            if v.phase == phase and v.state == VPodState.READY:
                groups[v.group] = groups.get(v.group, 0) + 1
        return groups

    def cost_usd(self, v: SimVPod, stop_s: float) -> float:
        """Dollars for every chip-second the vPod was held."""
        return self.catalog.get(v.chip).vpod_usd(v.num_chips, max(0.0, stop_s - v.created_s))
