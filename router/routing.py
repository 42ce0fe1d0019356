"""Pure routing logic shared by the live gateway and the cluster simulator (paper §3.4).

* The **routing table** maps each sequence-length bucket (the DSE's 48 buckets) to a vPod group;
  the autoscaling policy produces it. Prefill routes by input length, decode by input +
  predicted output length.
* Inside a group a request goes to the **least-loaded** vPod.
* A request is **re-predicted** whenever its length crosses a bucket boundary, and **migrated**
  to the group for longer sequences when its length (or the new estimate) exceeds twice the
  best-fit length of its current group.

No I/O, no clock: plain functions and a frozen table.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Mapping, TypeVar

import numpy as np

from dse.buckets import SEQ_BUCKETS
from dse.errors import NeuScaleError

MIGRATE_FACTOR = 2.0  # §3.4: migrate past twice the group's best-fit length
T = TypeVar("T")


@dataclass(frozen=True)
class RoutingTable:
    """``groups[i]`` serves bucket ``i`` (upper edge ``edges[i]``); ``best_len[g]`` is the
    best-fit (representative) length of group ``g``."""

    edges: tuple[int, ...]
    groups: tuple[Hashable, ...]
    best_len: Mapping[Hashable, int]

    @classmethod
    def build(cls, bucket_to_group: Mapping[int, Hashable], edges: tuple[int, ...] = SEQ_BUCKETS
              ) -> "RoutingTable":
        """From a partial map bucket index -> group: buckets without a group are served by the
        nearest bucket that has one (longer preferred on ties: it fits in memory)."""
        if not bucket_to_group:
            raise NeuScaleError("routing table needs at least one group")
        known = sorted(bucket_to_group)
        groups = []
        for i in range(len(edges)):
            j = bisect_left(known, i)
            if j < len(known) and known[j] == i:
                groups.append(bucket_to_group[i])
                continue
            below = known[j - 1] if j > 0 else None
            above = known[j] if j < len(known) else None
            pick = above if below is None or (above is not None and above - i <= i - below) \
                else below
            groups.append(bucket_to_group[pick])
        best: dict[Hashable, int] = {}
        for i in known:
            g = bucket_to_group[i]
            best[g] = max(best.get(g, 0), edges[i])
        return cls(tuple(edges), tuple(groups), best)

    def bucket(self, length: int) -> int:
        """The bucket of a sequence of ``length`` tokens (the last one for longer ones)."""
        return min(bisect_left(self.edges, max(1, int(length))), len(self.edges) - 1)

    def group_for_length(self, length: int) -> Hashable:
        """Prefill routes by the input length, decode by input + (predicted) output."""
        return self.groups[self.bucket(length)]

    def next_boundary(self, length: int) -> int | None:
        """The length at which a sequence now ``length`` tokens long enters the next bucket
        (its output is re-predicted then, §3.4); None past the last bucket."""
        b = bisect_left(self.edges, length)
        return self.edges[b] + 1 if b < len(self.edges) else None

    def longer_group(self, group: Hashable) -> Hashable | None:
        """The group that serves the buckets right above ``group``'s longest one."""
        idx = [i for i, g in enumerate(self.groups) if g == group]
        if not idx:
            return None
        for g in self.groups[max(idx) + 1:]:
            if g != group:
                return g
        return None


def bucket_indices(edges: tuple[int, ...], lengths: np.ndarray) -> np.ndarray:
    """:meth:`RoutingTable.bucket` of many lengths at once."""
    e = np.asarray(edges)
    return np.searchsorted(e, np.clip(lengths, 1, e[-1]), side="left")


def least_loaded(vpods: Iterable[T], load: Callable[[T], float]) -> T:
    """The vPod with the smallest ``load(vpod)`` (ties: the first)."""
    try:
        return min(vpods, key=load)
    except ValueError:
        raise NeuScaleError("no vPod in the group") from None


def free_slot_first(vpods: Iterable[T], held: Callable[[T], float],
                    load: Callable[[T], float]) -> T:
    """Decode: the vPod with the smallest ``load`` among those with a batch slot free
    (``held(vpod)`` < 1, the share of its slots its requests in flight take), else among all
    (ties: the first). An answer then waits only when every vPod of its group is full - the
    queue the load-aware policy sizes a decode group by (all its slots pooled:
    ``LoadAwarePolicy.POOLED_DECODE``). The least load alone can pick a full vPod whose
    answers are short over one with slots free and longer ones. The gateway counts a vPod's
    requests in flight as they start and finish; the cluster simulator projects them from
    what it gave the engines (``sim.vpod.VPodEngines.held_share``)."""
    vpods = list(vpods)
    free = [v for v in vpods if held(v) < 1.0]
    return least_loaded(free or vpods, load)


def handing_over(routing: RoutingTable | None, planned: RoutingTable | None) -> set[Hashable]:
    """Groups that ``routing`` (the table in force, :func:`make_before_break`'s) still sends a
    bucket that ``planned`` gives to another group: hand-offs waiting for the taker to be up.
    The drivers hold a scale-in of such a group until its hand-off is done, so a group that a
    re-choice takes buckets from keeps the capacity serving them until the new group can (make
    before break for the vPods, as :func:`make_before_break` is for the buckets)."""
    if routing is None or planned is None or routing.edges != planned.edges:
        return set()
    return {g for g, p in zip(routing.groups, planned.groups) if g != p}


def crossed_bucket(table: RoutingTable, old_length: int, new_length: int) -> bool:
    """True when a growing sequence enters a new bucket: time to re-predict its output."""
    return table.bucket(new_length) != table.bucket(old_length)


def should_migrate(table: RoutingTable, group: Hashable, current_length: int,
                   estimated_total_length: int) -> Hashable | None:
    """The group to migrate to, or None: when the current length or the new estimate of the
    total length exceeds twice the group's best-fit length (§3.4)."""
    best = table.best_len.get(group)
    if best is None:
        return None
    if max(current_length, estimated_total_length) > MIGRATE_FACTOR * best:
        target = table.group_for_length(max(current_length, estimated_total_length))
        if target == group:
            target = table.longer_group(group)
        return target
    return None


def make_before_break(new: RoutingTable, old: RoutingTable | None,
                      ready: Callable[[Hashable], bool]) -> RoutingTable:
    """The table to route by while a plan is actuated: a bucket whose new group is not ready
    stays with its old group when that one is and was sized for the bucket's length (its
    best-fit length is not shorter), so no request waits for vPods to start while running
    ones can serve it. Once every bucket's new group is ready this is ``new``.

    ``ready(group)`` is the drivers' test that a group can take what is routed to it: *all*
    the capacity its plan ordered is up (a ready vPod and none still starting), not one ready
    vPod - a group re-chosen to an allocation it already ran one vPod of took the buckets of
    twelve running vPods on that one while its other ten loaded Llama3.1-405B's weights, and
    queued 5,000 prompts (the Azure day's 16:45)."""
    if old is None or old.edges != new.edges:
        return new
    groups = []
    changed = False
    for edge, g_new, g_old in zip(new.edges, new.groups, old.groups):
        if g_new != g_old and not ready(g_new) and ready(g_old) and \
                old.best_len.get(g_old, 0) >= edge:
            groups.append(g_old)
            changed = True
        else:
            groups.append(g_new)
    if not changed:
        return new
    best = {g: old.best_len[g] for g in set(groups) if g in old.best_len}
    best.update({g: n for g, n in new.best_len.items()})
    return RoutingTable(new.edges, tuple(groups), best)


def ready_group(table: RoutingTable, group: Hashable, length: int,
                ready: Callable[[Hashable], bool]) -> Hashable | None:
    """Where a decode request the table sends to ``group`` starts now: ``group`` when it has
    a ready vPod; else, of the table's groups with a ready vPod whose best-fit length holds the
    request's ``length`` (its tokens so far), the one of the shortest best-fit length - it can
    start the sequence at once, and the migration rule (:func:`should_migrate`) moves it on
    if it outgrows that group; None when no ready group holds it (the request waits for
    ``group``'s vPods, as before).

    A decode request reaches a group with nothing up when its predicted length falls in a
    bucket only a group still starting serves - a new length's group, which make-before-break
    gives the buckets no running group was sized for. The predicted length is the least
    reliable thing about a request (§5.1: 60 % accuracy), and waiting minutes for vPods to
    start costs a short answer its TPOT SLO (Llama3-8B LV-Eval-like decode, 2 h: ~2.6 % of
    its decode requests parked behind a starting v6e-4 while v5p-1 and v6e-2 groups that held
    them were up; README, "The serving stack" and "Decode candidates from every front")."""
    if ready(group):
        return group
    best = None
    for g in set(table.groups):
        n = table.best_len.get(g, 0)
        if g != group and n >= length and ready(g) and (best is None or (n, str(g)) < best[0]):
            best = ((n, str(g)), g)
    return None if best is None else best[1]
