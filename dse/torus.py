"""The ICI torus of a vPod: which dimensions the TP, EP and PP groups span, and what their
collectives cost (paper §3.3).

Shared by the roofline (:mod:`dse.costmodel`, peak link bandwidth) and the per-operator chip
model (:mod:`sim.chip`, which scales the bandwidth term to the achieved link bandwidth). Every
collective is ``alpha + beta * M`` seconds for a message of ``M`` bytes and sends ``gamma * M``
ICI bytes per chip: ring algorithms per torus dimension, bidirectional where the slice has
wrap-around links, plus a per-hop latency.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .catalog import ChipSpec
from .errors import NeuScaleError
from .parallel import Parallelism
from .vpod import ICITopology


def group_dims(topo: ICITopology, chip: ChipSpec, par: Parallelism
               ) -> dict[str, list[tuple[int, bool]]]:
    """Assign torus dimensions to the TP, then EP, then PP groups (largest dimensions first, so
    the most communication-heavy group gets the longest rings). Returns, per group, the
    (extent, has_wraparound) of each dimension it spans. Under tensor-parallel attention
    (``par.attn == "tp"``) the ``tp`` and ``ep`` groups are the same ``tp * ep`` chips; under
    the hybrid layout the ``ep`` entry (the experts' all-to-all) spans the ``tp`` group's
    dimensions and the data-parallel groups' ones: the whole stage."""
    if topo.num_chips != par.chips:
        raise NeuScaleError(f"{par} uses {par.chips} chips but topology {topo} has "
                            f"{topo.num_chips}")
    wrap = topo.has_wraparound(chip)
    order = sorted(range(topo.ndim), key=lambda i: -topo.dims[i])

    def assign(groups) -> dict[str, list[tuple[int, bool]]]:
        remaining = {i: topo.dims[i] for i in order}
        got: dict[str, list[tuple[int, bool]]] = {"tp": [], "ep": [], "pp": []}
        for name, need in groups:
            for i in order:
                if need == 1:
                    break
                f = min(need, remaining[i])
                if f > 1:
                    got[name].append((f, wrap and f == topo.dims[i]))
                    remaining[i] //= f
                    need //= f
        return got

    # tensor-parallel attention: the TP group (all-reduces) spans the whole stage, and the
    # experts' all-to-all runs over the same chips
    if par.attn == "tp":
        stage = assign((("tp", par.stage_chips), ("pp", par.pp)))
        return {"tp": stage["tp"], "ep": list(stage["tp"]), "pp": stage["pp"]}
    out = assign((("tp", par.tp), ("ep", par.ep), ("pp", par.pp)))
    if par.attn == "hybrid":
        # the same chips as the tp and ep groups together (both fill the largest dimensions
        # first), laid as one group: a dimension they share is one ring, not two
        out["ep"] = assign((("tp", par.stage_chips), ("pp", par.pp)))["tp"]
    return out


@dataclass(frozen=True)
class Collective:
    """time = alpha_s + beta_s_per_byte * M; ICI bytes sent per chip = gamma * M."""
    alpha_s: float = 0.0
    beta_s_per_byte: float = 0.0
    gamma: float = 0.0


def allreduce_cost(dims: list[tuple[int, bool]], chip: ChipSpec) -> Collective:
    """Ring reduce-scatter + all-gather, one torus dimension after another. With D dimensions the
    message is split into D parts that walk the dimensions in rotated orders at the same time
    (each part uses different links), so the bandwidth term is shared D ways."""
    a = b = g = 0.0
    frac = 1.0
    for k, wrap in dims:
        bw = chip.ici_link_bw_bytes_per_s * (2 if wrap else 1)
        a += 2 * (k - 1) * chip.ici_hop_latency_s
        b += 2 * (k - 1) / k * frac / bw
        g += 2 * (k - 1) / k * frac
        frac /= k
    return Collective(a, b / max(1, len(dims)), g)


def allgather_cost(dims: list[tuple[int, bool]], chip: ChipSpec) -> Collective:
    """The all-gather half of :func:`allreduce_cost`."""
    ar = allreduce_cost(dims, chip)
    return Collective(ar.alpha_s / 2, ar.beta_s_per_byte / 2, ar.gamma / 2)


def alltoall_cost(dims: list[tuple[int, bool]], chip: ChipSpec) -> Collective:
    """Dimension-ordered all-to-all; M = bytes one chip sends in total. On a ring of k chips each
    byte travels k/4 hops on average (k/3 without wrap-around) and the bisection limits the time
    to M*k/8 (M*k/4) per link bandwidth, or the injection limit M(k-1)/k per ring bandwidth."""
    a = b = g = 0.0
    lb = chip.ici_link_bw_bytes_per_s
    for k, wrap in dims:
        ring_bw = lb * (2 if wrap else 1)
        b += max((k - 1) / k / ring_bw, k / (8 if wrap else 4) / lb)
        a += (k - 1) * chip.ici_hop_latency_s
        g += max(1.0, k / (4 if wrap else 3))
    return Collective(a, b, g)


def p2p_cost(chip: ChipSpec) -> Collective:
    """One message to a neighbour (the PP activation send)."""
    return Collective(chip.ici_hop_latency_s, 1.0 / chip.ici_link_bw_bytes_per_s, 1.0)


def collectives(topo: ICITopology, chip: ChipSpec, par: Parallelism) -> dict[str, Collective]:
    """The collective table of one allocation: TP all-reduce ``ar`` and all-gather ``ag``, EP
    all-to-all ``a2a`` and PP send ``p2p``."""
    gd = group_dims(topo, chip, par)
    return {"ar": allreduce_cost(gd["tp"], chip), "ag": allgather_cost(gd["tp"], chip),
            "a2a": alltoall_cost(gd["ep"], chip), "p2p": p2p_cost(chip)}


def stack_collectives(colls: list[dict[str, Collective]]) -> dict[str, Collective]:
    """Many topologies' tables as one table of [T, 1, 1] coefficient arrays."""
    return {k: Collective(*(np.array([getattr(c[k], a) for c in colls]).reshape(-1, 1, 1)
                            for a in ("alpha_s", "beta_s_per_byte", "gamma")))
            for k in colls[0]}


__all__ = ["group_dims", "Collective", "allreduce_cost", "allgather_cost", "alltoall_cost",
           "p2p_cost", "collectives", "stack_collectives"]
