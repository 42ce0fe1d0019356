"""The autoscaling policy (paper §3.4): pure, clock-free, one implementation for the cluster
simulator and the live controller.

Every epoch the caller hands :meth:`Policy.plan` what it observed over the last window and what
it owns; the policy returns a :class:`Plan` - vPods to create, delete or replace, groups created,
merged and evicted, background DSE requests - each with its reason, plus the new
sequence-length -> group routing table and the policy's own state for the next epoch.

Load is measured in **tokens per second** per sequence bucket (prefill: input tokens, decode:
generated tokens), sampled every ``sample_s``. The paper states N_pod = ceil(R_peak / T_pod) in
requests; the DSE's per-vPod throughput is in tokens/s and requests in one bucket differ in
length, so tokens are the unit in which R and T compare exactly.

Rules (defaults in :class:`PolicyConfig`, all from §3.4):

* a group per distinct best-fit allocation of the buckets seen in the window;
* N_pod = ceil(R / T_pod); at most x2 per epoch up, at most /2 per 30 min down. R is the peak of
  the last epoch or, when that is lower, an EWMA of the per-epoch peaks: a rise is followed at
  once, a fall decays by ``ewma_alpha`` per epoch. (Taking R as the plain 30-min window peak, a
  finished burst would hold the vPods for 30 min and, after a scale-in, scale them out again;
  the EWMA is what lets the paper's system "scale in rapidly". The window still decides which
  buckets, hence groups, exist, and the coalescing test uses the window peak.);
* emergency scale-out when a group's peak aggregated queue (its vPods' and its router queue's,
  summed) exceeds its total max batch: bypasses the doubling limit and the epoch - a driver
  asks :class:`EmergencyGate` every sample and plans the emergency at once
  (:meth:`Policy.plan_emergency`), at most once per start-up of what it ordered;
* coalescing: a group with N_L = R_peak / T_pod < 0.5 merges into the group of the next longer
  bucket when that group absorbs its load without another vPod; repeated scans in ascending N_L;
* fail-over: when the best-fit chip has no quota, the best vPod of another allowed chip version
  for the same bucket (SLO-compliant first, then most efficient), in the same group; replaced by
  best-fit vPods as soon as quota allows;
* eviction: when neither fits, vPods of the lowest-R_peak group are taken;
* unseen lengths (no DB entry): served by the nearest bucket that has one, and a background DSE
  is requested for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from dse.db import BestFitDB, Entry
from dse.errors import NeuScaleError
from dse.vpod import VPodState
from router.routing import RoutingTable


@dataclass(frozen=True)
class PolicyConfig:
    window_s: float = 1800.0          # §3.4: statistics of the last 30 min
    epoch_s: float = 300.0            # §3.4: re-plan every 5 min
    sample_s: float = 10.0            # §3.4: rate samples every 10 s
    growth_per_epoch: float = 2.0     # at most double per epoch
    shrink_factor: float = 2.0        # at most halve ...
    shrink_period_s: float = 1800.0   # ... per 30 min
    ewma_alpha: float = 0.5           # weight of the newest epoch peak in the scale-in signal
    coalesce_below: float = 0.5       # N_L threshold for coalescing
    coalescing: bool = True
    # Not in the paper: merge only into a group whose allocation meets the SLO of every merged
    # bucket (its latency at the merged lengths from the policy's latency oracle, else, more
    # conservatively, its latency at its own longer bucket). Without it a short prompt can land
    # on a deep pipeline built for long ones (DeepSeek-V3: a 128-token prefill on v6e-64 PP16
    # takes 0.24 s against a 0.10 s SLO).
    coalesce_keep_slo: bool = True
    emergency: bool = True
    # The paper bypasses the x2 limit in an emergency but does not say by how much; one vPod per
    # max_batch queued requests is unbounded when max_batch is small (a queue of thousands of
    # prompts on max_batch=1 prefill vPods), so an emergency grows a group at most this factor
    # per epoch.
    emergency_max_factor: float = 4.0
    # A bound on the vPods one plan may order (per phase): a plan is a few hundred actions
    # at most, whatever a bad observation says (not in the paper).
    max_new_vpods: int = 256
    failover: bool = True
    failover_chips: tuple[str, ...] | None = None   # None: every chip version in the DB
    # the chip versions this autoscaler may use at all (§5.4's chip mixes: "C-only", or the
    # "expert choice" of v6e for prefill and v5p for decode); None: every chip in the DB.
    # Best fits are then the best among these chips (SLO-compliant first, then efficiency).
    chips: tuple[str, ...] | None = None
    eviction: bool = True
    # load-aware policy (orchestrator.loadaware, not in the paper): a better allocation must
    # stay the better one this many epochs in a row before a group switches to it
    rechoose_epochs: int = 2
    # load-aware decode picks: TPOT at full batch <= this x SLO. 1: the DSE's own SLO test (the
    # best fit's). Below 1 leaves room for a request's wait to join a running batch (up to a
    # step: (m + 1) / m steps per token for m decode steps), but it excludes the large-batch
    # points whose TPOT sits near the SLO and forces many small vPods, which queue more:
    # DeepSeek-V3, 2 h of the Azure day, 2/3 gave 0.45x the tokens/J and 96.6 % against 99.1 %
    decode_step_margin: float = 1.0

    def __post_init__(self) -> None:
        if self.growth_per_epoch < 1 or self.shrink_factor < 1:
            raise NeuScaleError("growth_per_epoch and shrink_factor must be >= 1")
        if not 0 < self.ewma_alpha <= 1:
            raise NeuScaleError("ewma_alpha must be in (0, 1]")
        if self.epoch_s <= 0 or self.window_s < self.epoch_s or self.sample_s <= 0:
            raise NeuScaleError("need 0 < sample_s, 0 < epoch_s <= window_s")
        if self.max_new_vpods < 1:
            raise NeuScaleError("max_new_vpods must be >= 1")


@dataclass(frozen=True)
class GroupSpec:
    """A vPod group: one best-fit allocation, the DB entry ``entry`` (every vPod of the group
    has it, fail-overs aside)."""
    id: str
    entry: Entry

    @classmethod
    def of(cls, e: Entry, prefix: str = "") -> "GroupSpec":
        # "dp" ids are unchanged; the other layouts are other allocations of the same split
        layout = {"tp": "tpattn", "hybrid": "hybrid"}.get(e.attn, "")
        return cls(f"{prefix}{e.chip}:{e.topology}/tp{e.tp}pp{e.pp}ep{e.ep}{layout}"
                   f"/b{e.max_batch}", e)

    @property
    def best_len(self) -> int:
        """The longest bucket the allocation is the best fit for."""
        return self.entry.seq_len


class ActionKind(StrEnum):
    CREATE = "create"               # one vPod (``failover``: on another chip version)
    DELETE = "delete"               # one vPod (``vpod_id``), after draining
    REPLACE = "replace"             # a fail-over vPod (``vpod_id``) by a best-fit one
    CREATE_GROUP = "create_group"   # a new best-fit allocation is routed to
    MERGE_GROUP = "merge_group"     # coalescing: the group's buckets go to a longer group
    EVICT_GROUP = "evict_group"     # nothing routes to the group any more
    DSE = "dse"                     # a length without a best fit: background DSE request
    UNSATISFIED = "unsatisfied"     # ``count`` vPods wanted that no allowed chip's quota allows
    CHOOSE = "choose_allocation"    # load-aware: the allocation a group runs, and why


@dataclass(frozen=True)
class VPodRecord:
    """A vPod as the policy sees it (an inventory record; the allocation is ``dse.vpod``'s
    ``VPodConfig``, the simulated or real engine behind it is the driver's business)."""
    id: str
    group: str
    chip: str
    topology: str
    num_chips: int
    state: VPodState = VPodState.READY     # the policy sees starting and ready ones
    failover: bool = False
    throughput_tok_per_s: float = 0.0
    max_batch: int = 0


@dataclass
class Observation:
    now_s: float
    bucket_token_rates: Mapping[int, np.ndarray]   # bucket -> samples (tokens/s), oldest first
    inventory: list[VPodRecord] = field(default_factory=list)
    # group -> its aggregated queue: the peak since the epoch began (an emergency plan between
    # epochs: the last sample's)
    group_peak_queue: Mapping[str, int] = field(default_factory=dict)
    available_chips: Mapping[str, int | None] = field(default_factory=dict)  # None: no limit
    # group -> the longest a request stayed on one of its vPods within the window (s): how long
    # its vPods take to drain once nothing new is routed to them
    group_drain_s: Mapping[str, float] = field(default_factory=dict)
    # bucket -> the mean time a request whose load was counted there held a vPod's server or
    # slot within the window (s; prefill: its prompt; decode: from joining a vPod to its last
    # token)
    bucket_stay_s: Mapping[int, float] = field(default_factory=dict)
    # False: a plan between epochs for an emergency (:meth:`Policy.plan_emergency`): nothing
    # that is counted per epoch (sizing, growth, EWMA, re-choice) moves
    epoch: bool = True


@dataclass
class GroupState:
    ewma_peak: float = 0.0
    last_shrink_s: float = -math.inf
    queued: bool = False              # the last plan's peak queue was beyond the group's slots
    queued_since_s: float = math.inf  # the first plan of that run of queued plans
    epoch_vpods: int = 0              # its vPods when the last epoch's plan began


@dataclass
class PolicyState:
    groups: dict[str, GroupState] = field(default_factory=dict)
    # the load-aware policy's memory: which group served each bucket in the last plan, the
    # allocations it chose (by group id), and per group leader a better allocation seen and for
    # how many epochs in a row
    chosen: dict[int, str] = field(default_factory=dict)
    allocs: dict[str, GroupSpec] = field(default_factory=dict)
    pending: dict[int, tuple[str, int]] = field(default_factory=dict)

    def copy(self) -> "PolicyState":
        return PolicyState({g: replace(s) for g, s in self.groups.items()}, dict(self.chosen),
                           dict(self.allocs), dict(self.pending))


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    group: str
    reason: str
    chip: str = ""
    topology: str = ""
    count: int = 0
    vpod_id: str = ""
    failover: bool = False


@dataclass
class Plan:
    actions: list[Action]
    routing: RoutingTable
    state: PolicyState
    groups: dict[str, GroupSpec]
    target: dict[str, int]                   # group -> vPods wanted
    rates: dict[str, float]                  # group -> R_peak (tokens/s)

    def explain(self) -> list[str]:
        return [f"{a.kind:12} {a.group:34} {a.chip + ':' + a.topology if a.chip else '':14} "
                f"x{a.count:<3} {'(fail-over) ' if a.failover else ''}{a.reason}"
                for a in self.actions]

    def to_json(self) -> dict[str, Any]:
        return {"actions": [a.__dict__ for a in self.actions], "target": self.target,
                "rates_tok_per_s": self.rates,
                "routing": {str(e): g for e, g in zip(self.routing.edges, self.routing.groups)}}


LatencyFn = Callable[[GroupSpec, str, int], float]


class Policy:
    """One autoscaler for one phase (prefill and decode are scaled independently).

    ``latency_fn(spec, phase, length)``: the latency (TTFT or TPOT, s) of a group's allocation
    at its max batch for sequences of ``length`` tokens -- a pure function of the allocation,
    e.g. the chip model's (the simulator passes its step-cost tables). The coalescing SLO check
    uses it; without it the check takes the group's latency at its own bucket (an upper bound).
    """

    def __init__(self, db: BestFitDB, phase: str, config: PolicyConfig = PolicyConfig(),
                 latency_fn: LatencyFn | None = None):
        if phase not in ("prefill", "decode"):
            raise NeuScaleError(f"phase must be 'prefill' or 'decode' (got {phase!r})")
        self.db, self.phase, self.cfg = db, phase, config
        self.edges = db.edges
        allowed = config.failover_chips
        slo = db.meta.get("slo_s", {}).get(phase)
        self._slo = list(slo) if slo else [math.inf] * len(db.edges)
        self.latency_fn = latency_fn
        self._lat_memo: dict[tuple[str, int], float] = {}
        self._between = False                # this plan is an emergency's, between epochs
        if config.chips is not None:
            unknown = [c for c in config.chips if c not in db.chips]
            if unknown or not config.chips:
                raise NeuScaleError(f"chips {list(config.chips)}: the best-fit database has "
                                    f"{list(db.chips)}")
        self.chips = list(config.chips) if config.chips is not None else None
        self.failover_chips = [c for c in db.chips if (allowed is None or c in allowed)
                               and (self.chips is None or c in self.chips)]

    # ---- best fit per bucket ------------------------------------------------------------------
    def _entry(self, i: int, chip: str | None = None) -> Entry | None:
        if chip is None and self.chips is not None:     # the best of the allowed chips
            cands = [e for c in self.chips
                     if (e := self.db.entry_at(self.phase, i, c)) is not None and e.feasible]
            return max(cands, key=lambda e: (e.meets_slo, e.efficiency), default=None)
        e = self.db.entry_at(self.phase, i, chip)
        return e if e is not None and e.feasible else None

    def _bucket_groups(self, buckets: list[int], actions: list[Action]
                       ) -> tuple[dict[int, str], dict[str, GroupSpec]]:
        b2g: dict[int, str] = {}
        specs: dict[str, GroupSpec] = {}
        have = [i for i in range(len(self.edges)) if self._entry(i) is not None]
        if not have:
            raise NeuScaleError(f"the best-fit database has no feasible {self.phase} entry")
        for i in buckets:
            e = self._entry(i)
            if e is None:   # unseen length: nearest bucket with an entry, DSE in the background
                j = min(have, key=lambda k: (abs(k - i), -k))
                e = self._entry(j)
                actions.append(Action(ActionKind.DSE, "", f"bucket <= {self.edges[i]} has no "
                                      f"best fit: served by bucket <= {self.edges[j]}, "
                                      "background DSE"))
            g = GroupSpec.of(e)
            specs.setdefault(g.id, g)
            b2g[i] = g.id
        return b2g, specs

    def _latency(self, spec: GroupSpec, i: int) -> float:
        """Latency of ``spec``'s allocation on bucket ``i`` (memoised; see the class doc)."""
        if self.latency_fn is None:
            return spec.entry.latency_s
        key = (spec.id, i)
        v = self._lat_memo.get(key)
        if v is None:
            v = self._lat_memo[key] = float(self.latency_fn(spec, self.phase, self.edges[i]))
        return v

    # ---- the plan: one stage per rule -----------------------------------------------------------
    def plan(self, obs: Observation, state: PolicyState | None = None) -> Plan:
        cfg = self.cfg
        state = state or PolicyState()
        self._between = not obs.epoch
        actions: list[Action] = []
        series = self._window(obs)
        owned = {v.group for v in obs.inventory if v.state != VPodState.DRAINING}
        if not series and not owned:
            return Plan([], RoutingTable.build({0: "none"}, self.edges), state, {}, {}, {})
        b2g, specs = self._bucket_groups(sorted(series), actions) if series else ({}, {})
        load = _GroupLoad(series, b2g)
        new_state = state.copy()
        self._regroup(load, specs, obs, new_state, owned, actions)
        avail = {c: (None if n is None else int(n)) for c, n in obs.available_chips.items()}
        inv: dict[str, list[VPodRecord]] = {}
        for v in obs.inventory:
            if v.state != VPodState.DRAINING:
                inv.setdefault(v.group, []).append(v)
        live = sorted(set(b2g.values()))
        rates = {g: float(load.series(g).max()) for g in live}
        self._evict_idle(inv, live, avail, actions, new_state)
        target: dict[str, int] = {}
        self._budget = cfg.max_new_vpods        # vPods this plan may still order
        for g in live:
            gs = new_state.groups.setdefault(g, GroupState())
            vpods = inv.get(g, [])
            want, why = self._size(specs[g], *self._demand(g, specs[g], load), gs, len(vpods),
                                   obs.now_s)
            want, why = self._emergency(specs[g], vpods, obs.group_peak_queue.get(g, 0),
                                        want, why, gs)
            if rates[g] == 0 and obs.group_peak_queue.get(g, 0) == 0:
                want, why = 0, "no traffic in the window"
            target[g] = want
            self._actuate(g, specs[g], want, vpods, why, avail, actions, rates, inv)
        routing = RoutingTable.build(b2g or {0: "none"}, self.edges)
        return Plan(actions, routing, new_state, specs, target, rates)

    def plan_emergency(self, obs: Observation, state: PolicyState | None,
                       groups: Iterable[str]) -> Plan:
        """A plan between epochs for ``groups`` (those :class:`EmergencyGate` names): §3.4's
        emergency scale-out "bypasses the doubling constraint to quickly absorb workload
        spikes", and a spike does not wait for the epoch. Only those groups' emergency
        scale-out is carried out, on what runs: no sizing (the growth limit, the EWMA and the
        re-choice hold count epochs), no merge, re-choice, eviction or scale-in, and every
        other group's state stays as the last plan left it. The driver keeps its routing
        table (the returned ``routing`` is the plan's view, not to be published)."""
        full = self.plan(replace(obs, epoch=False), state)
        keep = set(groups)
        acts = [a for a in full.actions if a.group in keep
                and a.kind in (ActionKind.CREATE, ActionKind.UNSATISFIED)]
        new = (state or PolicyState()).copy()
        for g in keep:
            if g in full.state.groups:
                new.groups[g] = full.state.groups[g]
        return Plan(acts, full.routing, new, full.groups,
                    {g: n for g, n in full.target.items() if g in keep},
                    {g: r for g, r in full.rates.items() if g in keep})

    def _regroup(self, load: "_GroupLoad", specs: dict[str, GroupSpec], obs: Observation,
                 state: PolicyState, owned: set[str], actions: list[Action]) -> None:
        """From the best-fit groups to the groups the plan runs (``load.b2g`` changes in
        place): the paper's coalescing. (The load-aware policy also re-chooses allocations.)"""
        b2g = load.b2g
        for g in sorted(set(b2g.values())):
            if g not in owned:
                actions.append(Action(ActionKind.CREATE_GROUP, g, "best fit of bucket(s) <= "
                                      + ", ".join(str(self.edges[i]) for i in sorted(b2g)
                                                  if b2g[i] == g)))
        if self.cfg.coalescing:
            self._coalesce(load, specs, actions)

    def _demand(self, g: str, spec: GroupSpec, load: "_GroupLoad") -> tuple[np.ndarray, float]:
        """The group's load series and the throughput of one vPod in its unit: tokens/s and
        the allocation's tokens/s at its best-fit bucket (the paper's N_pod = R / T_pod)."""
        return load.series(g), spec.entry.throughput_tok_per_s

    def _recent_peak(self, s: np.ndarray) -> float:
        """The peak that sizes a group: the last epoch's (a finished burst is released within
        an epoch or two through the EWMA)."""
        n_epoch = max(1, int(round(self.cfg.epoch_s / self.cfg.sample_s)))
        return float(s[-n_epoch:].max())

    def _n_pod(self, g: str, r: float, T: float) -> int:
        """vPods for a load of ``r`` at ``T`` each: N_pod = ceil(R / T_pod) (§3.4)."""
        return math.ceil(r / T - 1e-9)

    def _window(self, obs: Observation) -> dict[int, np.ndarray]:
        """Per bucket with traffic, the window's rate samples (tokens/s, oldest first)."""
        n_window = max(1, int(round(self.cfg.window_s / self.cfg.sample_s)))
        return {i: np.asarray(r, dtype=np.float64)[-n_window:]
                for i, r in obs.bucket_token_rates.items() if len(r) and np.max(r) > 0}

    def _coalesce(self, load: "_GroupLoad", specs: dict[str, GroupSpec],
                  actions: list[Action]) -> None:
        """Merge under-used groups (N_L = R_peak / T_pod below ``coalesce_below``) into a longer
        group with room, one at a time in ascending N_L, until nothing merges."""
        while self._merge_one(load, specs, actions):
            pass

    def _merge_one(self, load: "_GroupLoad", specs: dict[str, GroupSpec],
                   actions: list[Action]) -> bool:
        cfg, b2g = self.cfg, load.b2g
        live = sorted(set(b2g.values()))
        nl = {g: load.series(g).max() / specs[g].entry.throughput_tok_per_s for g in live}
        for g in sorted(live, key=nl.get):
            if nl[g] >= cfg.coalesce_below:
                return False
            mine = [i for i in b2g if b2g[i] == g]
            target, spare = self._merge_target(g, mine, load, specs)
            if target is None:
                continue
            for i in mine:
                b2g[i] = target
            actions.append(Action(ActionKind.MERGE_GROUP, g, f"N_L={nl[g]:.2f} < "
                                  f"{cfg.coalesce_below}: merged into {target}, "
                                  f"which has {spare:,.0f} tok/s spare"))
            return True
        return False

    def _merge_target(self, g: str, mine: list[int], load: "_GroupLoad",
                      specs: dict[str, GroupSpec]) -> tuple[str | None, float]:
        """The group ``g`` merges into, and that group's spare throughput: the next longer
        group (the paper's rule) or, keeping the SLO, the nearest longer one whose allocation
        meets the SLO of every bucket of ``g``; it must absorb ``g``'s load without a vPod
        more."""
        b2g, keep_slo = load.b2g, self.cfg.coalesce_keep_slo
        longest = max(mine)
        longer: list[str] = []
        for i in sorted(b2g):
            if i > longest and b2g[i] != g and b2g[i] not in longer:
                longer.append(b2g[i])
        if not keep_slo:
            longer = longer[:1]
        r_g = load.series(g).max()
        spare = 0.0
        for cand in longer:
            if keep_slo and not all(self._latency(specs[cand], i) <= self._slo[i] for i in mine):
                continue
            r_t = load.series(cand).max()
            t_t = specs[cand].entry.throughput_tok_per_s
            spare = max(1, math.ceil(r_t / t_t)) * t_t - r_t
            if spare >= r_g:
                return cand, spare
        return None, spare

    def _evict_idle(self, inv: dict[str, list[VPodRecord]], live: list[str],
                    avail: dict[str, int | None], actions: list[Action],
                    state: PolicyState) -> None:
        """Groups that lost all their buckets (merged away, or no traffic): delete their vPods."""
        for g in sorted(set(inv) - set(live)):
            for v in inv[g]:
                actions.append(Action(ActionKind.DELETE, g, "group evicted: no traffic routed "
                                      "to it", v.chip, v.topology, 1, v.id, v.failover))
                _free(avail, v.chip, v.num_chips)
            actions.append(Action(ActionKind.EVICT_GROUP, g, "N_pod = 0"))
            state.groups.pop(g, None)

    def _size(self, spec: GroupSpec, s: np.ndarray, T: float, gs: GroupState, current: int,
              now_s: float) -> tuple[int, str]:
        """N_pod = ceil(R / T_pod): at most x``growth_per_epoch`` up per epoch, at most
        /``shrink_factor`` down per ``shrink_period_s``; R is the last epoch's peak or, when
        lower, the EWMA of epoch peaks (updated in ``gs``). Between epochs (an emergency plan)
        the group keeps its size: only the emergency rule scales it."""
        cfg = self.cfg
        if self._between:
            return current, "between epochs"
        n_pod, r_now = self._target(spec, s, T, gs)
        if n_pod > current:
            cap = max(1, math.floor(current * cfg.growth_per_epoch)) if current else n_pod
            want = min(n_pod, cap)
            return want, (f"R_peak {r_now:,.0f} tok/s needs {n_pod} x {T:,.0f}"
                          + (f", capped at x{cfg.growth_per_epoch:g} per epoch"
                             if want < n_pod else ""))
        if n_pod < current and now_s - gs.last_shrink_s >= cfg.shrink_period_s:
            want = max(n_pod, math.ceil(current / cfg.shrink_factor))
            gs.last_shrink_s = now_s
            return want, (f"R_peak (EWMA) {r_now:,.0f} tok/s needs {n_pod}"
                          + (f", at most /{cfg.shrink_factor:g} per "
                             f"{cfg.shrink_period_s / 60:g} min" if want > n_pod else ""))
        return current, "steady"

    def _target(self, spec: GroupSpec, s: np.ndarray, T: float, gs: GroupState
                ) -> tuple[int, float]:
        """The vPods the group's load needs before the growth and shrink limits, and the load
        R it reads (updating the EWMA of epoch peaks in ``gs``): N_pod = ceil(R / T_pod)."""
        cfg = self.cfg
        epoch_peak = self._recent_peak(s)
        gs.ewma_peak = (epoch_peak if gs.ewma_peak == 0.0 else
                        cfg.ewma_alpha * epoch_peak + (1 - cfg.ewma_alpha) * gs.ewma_peak)
        r_now = max(epoch_peak, gs.ewma_peak)
        return self._n_pod(spec.id, r_now, T), r_now

    def emergency_due(self, group: str, queue: int, slots: int) -> bool:
        """Whether a group's peak queue calls for the emergency scale-out (§3.4: it bypasses
        the epoch, so a driver plans at once): beyond its batch slots (vPods starting
        included) x its queue tolerance - the test :meth:`_emergency` applies in the plan.
        A driver that tested the slots alone would re-plan a load-aware prefill group every
        sample while its queue waits within its slack, and every such plan counts as an
        epoch for the re-choice hold."""
        return bool(self.cfg.emergency) and queue > slots * self._queue_tolerance(group)

    def _queue_tolerance(self, g: str) -> float:
        """How many times its batch slots a group's queue may reach before it is an
        emergency. The paper's rule: 1 (its vPods are sized at utilisation 1, so any queue
        beyond a step's batch waits). The load-aware policy overrides it."""
        return 1.0

    def _emergency(self, spec: GroupSpec, vpods: list[VPodRecord], queue: int, want: int,
                   why: str, gs: GroupState) -> tuple[int, str]:
        """Emergency scale-out past the doubling limit when the peak queue exceeds the group's
        batch slots (vPods still starting count: capacity on its way; without them every epoch
        of a start-up would order the same vPods again), at most x``emergency_max_factor`` per
        epoch."""
        cfg = self.cfg
        current = len(vpods)
        if not self._between:
            gs.epoch_vpods = current
        mb = spec.entry.max_batch
        slots = sum(v.max_batch or mb for v in vpods)
        tolerance = self._queue_tolerance(spec.id)
        if not cfg.emergency or queue <= slots * tolerance:
            return want, why
        extra = math.ceil((queue - slots * tolerance) / max(mb * tolerance, 1))
        if self._between:     # x emergency_max_factor per epoch: of what ran when it began
            bound = max(current, math.ceil(max(gs.epoch_vpods, 1) * cfg.emergency_max_factor))
        else:
            bound = max(current + 1, math.ceil(current * cfg.emergency_max_factor))
        new = min(current + extra, bound)
        if new <= want:
            return want, why
        return new, (f"emergency: peak queue {queue} > {slots} batch slots"
                     + (f" x {tolerance:.3g} (its SLO slack)" if tolerance != 1 else "")
                     + " (doubling limit "
                     "bypassed" + (f", at most x{cfg.emergency_max_factor:g} per epoch)"
                                   if new < current + extra else ")"))

    # ---- actuation under quotas: fail-over, replacement, eviction --------------------------------
    def _actuate(self, g: str, spec: GroupSpec, want: int, vpods: list[VPodRecord], why: str,
                 avail: dict[str, int | None], actions: list[Action], rates: dict[str, float],
                 inv: dict[str, list[VPodRecord]]) -> None:
        e = spec.entry
        current = len(vpods)
        if want < current:       # fail-overs first, then starting ones, then the newest
            order = sorted(vpods, key=lambda v: (not v.failover, v.state != VPodState.STARTING))
            for v in order[:current - want]:
                actions.append(Action(ActionKind.DELETE, g, why, v.chip, v.topology, 1, v.id,
                                      v.failover))
                _free(avail, v.chip, v.num_chips)
            vpods = order[current - want:]
        # replace fail-over vPods by best-fit ones while quota allows
        for v in [v for v in vpods if v.failover]:
            if _take(avail, e.chip, e.num_chips):
                actions.append(Action(ActionKind.REPLACE, g, f"best fit {e.chip} available "
                                      "again", e.chip, e.topology, 1, v.id))
                _free(avail, v.chip, v.num_chips)
        missing = want - min(current, want)
        while missing > 0:
            if self._budget <= 0:
                actions.append(Action(ActionKind.UNSATISFIED, g, f"{why}; this plan has "
                                      f"ordered its {self.cfg.max_new_vpods} new vPods",
                                      e.chip, e.topology, missing))
                break
            if _take(avail, e.chip, e.num_chips):
                actions.append(Action(ActionKind.CREATE, g, why, e.chip, e.topology, 1))
                missing -= 1
                self._budget -= 1
                continue
            fo = self._failover(spec, avail) if self.cfg.failover else None
            if fo is not None:
                actions.append(Action(ActionKind.CREATE, g, f"{why}; {e.chip} quota exhausted: "
                                      f"fail-over to {fo.chip}", fo.chip, fo.topology, 1,
                                      failover=True))
                missing -= 1
                self._budget -= 1
                continue
            if self.cfg.eviction and self._evict_for(g, spec, avail, actions, rates, inv):
                continue
            actions.append(Action(ActionKind.UNSATISFIED, g, f"{why}; no quota on any allowed "
                                  "chip", e.chip, e.topology, missing))
            break

    def _failover(self, spec: GroupSpec, avail: dict[str, int | None]) -> Entry | None:
        """The best allocation of another allowed chip for the group's bucket (SLO-compliant
        first, then most efficient) that quota allows; its chips are taken from ``avail``."""
        i = min(range(len(self.edges)), key=lambda k: abs(self.edges[k] - spec.best_len))
        cands = []
        for c in self.failover_chips:
            if c == spec.entry.chip:
                continue
            e = self._entry(i, c)
            if e is not None:
                cands.append(e)
        cands.sort(key=lambda e: (not e.meets_slo, -e.efficiency))
        for e in cands:
            if _take(avail, e.chip, e.num_chips):
                return e
        return None

    def _evict_for(self, g: str, spec: GroupSpec, avail: dict[str, int | None],
                   actions: list[Action], rates: dict[str, float],
                   inv: dict[str, list[VPodRecord]]) -> bool:
        """Free one vPod of the lowest-R_peak other group that runs on a usable chip."""
        usable = {spec.entry.chip, *(self.failover_chips if self.cfg.failover else [])}
        for other in sorted((o for o in inv if o != g and inv[o]),
                            key=lambda o: rates.get(o, 0.0)):
            if rates.get(other, 0.0) >= rates.get(g, 0.0):
                return False
            for v in inv[other]:
                if v.chip in usable:
                    inv[other].remove(v)
                    _free(avail, v.chip, v.num_chips)
                    actions.append(Action(ActionKind.DELETE, other, f"evicted for {g} (lowest "
                                          f"R_peak {rates.get(other, 0.0):,.0f} tok/s)", v.chip,
                                          v.topology, 1, v.id, v.failover))
                    return True
        return False


class EmergencyGate:
    """Which groups a driver plans for between epochs (:meth:`Policy.plan_emergency`): those
    whose aggregated queue in the last sample is an emergency by their policy
    (:meth:`Policy.emergency_due`), once per start-up. A group whose emergency a plan acted on
    (between epochs, or at the epoch) waits until the vPods it had starting then are up: what
    is on its way is counted in its slots, and a plan before it arrives can only order more
    for the same queue (each a full plan, 0.1-1.5 s; the paper's rule doubles per plan). An
    emergency plan that could order nothing (quota, the plan's budget) waits for the next
    epoch. Both drivers keep one and call :meth:`due` every sample, :meth:`acted` after
    every plan and :meth:`new_epoch` before the epoch's plan. (Judged on the epoch's peak
    queue, a group whose wait ended was planned for again on a queue that the vPods it
    waited for may have served: once they were up, a plan up to the epoch's bound.)"""

    def __init__(self) -> None:
        # (phase, group) -> the ids of its vPods starting after the plan that acted on its
        # emergency (empty: wait for the epoch)
        self._wait: dict[tuple[str, str], frozenset[str]] = {}

    def due(self, phase: str, policy: Policy, peak_queue: Mapping[str, int],
            inventory: Iterable[VPodRecord], at_epoch: bool = False) -> list[str]:
        """The groups of ``phase`` to plan for now, sorted (``at_epoch``: those the epoch's
        plan acts on - no group waits for it)."""
        if not peak_queue:
            return []
        slots: dict[str, int] = {}
        starting: dict[str, set[str]] = {}
        for v in inventory:
            if v.state in (VPodState.STARTING, VPodState.READY):
                slots[v.group] = slots.get(v.group, 0) + v.max_batch
                if v.state == VPodState.STARTING:
                    starting.setdefault(v.group, set()).add(v.id)
        out = []
        for g, q in sorted(peak_queue.items()):
            wait = None if at_epoch else self._wait.get((phase, g))
            if wait is not None:
                if not wait or wait & starting.get(g, set()):
                    continue
                del self._wait[(phase, g)]
            if policy.emergency_due(g, q, slots.get(g, 0)):
                out.append(g)
        return out

    def acted(self, phase: str, groups: Iterable[str],
              inventory: Iterable[VPodRecord]) -> None:
        """A plan acted on ``groups``' emergencies; ``inventory`` is what runs after it."""
        groups = set(groups)
        if not groups:
            return
        starting: dict[str, set[str]] = {g: set() for g in groups}
        for v in inventory:
            if v.group in groups and v.state == VPodState.STARTING:
                starting[v.group].add(v.id)
        for g, ids in starting.items():
            self._wait[(phase, g)] = frozenset(ids)

    def new_epoch(self) -> None:
        """The epoch's plan: groups whose emergency plan ordered nothing may be planned for
        again."""
        self._wait = {k: w for k, w in self._wait.items() if w}

    def to_json(self) -> list[list[Any]]:
        """What the controller keeps in its state file: ``[phase, group, [vPod ids]]`` per
        group waiting."""
        return [[ph, g, sorted(w)] for (ph, g), w in sorted(self._wait.items())]

    @classmethod
    def from_json(cls, rows: Iterable[Iterable[Any]]) -> "EmergencyGate":
        gate = cls()
        for ph, g, ids in rows:
            gate._wait[(str(ph), str(g))] = frozenset(str(i) for i in ids)
        return gate


class _GroupLoad:
    """A phase's window of per-bucket token-rate samples seen through the bucket -> group map
    ``b2g`` (which coalescing changes in place): the summed samples of a group's buckets."""

    def __init__(self, series: dict[int, np.ndarray], b2g: dict[int, str]):
        self.b2g = b2g
        self._series = series
        self._length = max((len(s) for s in series.values()), default=1)

    def series(self, g: str) -> np.ndarray:
        out = np.zeros(self._length)
        for i, gid in self.b2g.items():
            if gid == g:
                s = self._series[i]
                out[self._length - len(s):] += s
        return out

    def weighted(self, g: str, weight: Mapping[int, float]) -> np.ndarray:
        """The group's samples with bucket ``i``'s rate times ``weight[i]``."""
        out = np.zeros(self._length)
        for i, gid in self.b2g.items():
            if gid == g:
                s = self._series[i]
                out[self._length - len(s):] += s * weight[i]
        return out

    def matrix(self, buckets: list[int]) -> np.ndarray:
        """Samples x buckets (the window's length; missing samples are 0)."""
        out = np.zeros((self._length, len(buckets)))
        for k, i in enumerate(buckets):
            s = self._series[i]
            out[self._length - len(s):, k] = s
        return out


def _take(avail: dict[str, int | None], chip: str, n: int) -> bool:
    have = avail.get(chip, None) if chip in avail else None
    if have is None:
        return True
    if have >= n:
        avail[chip] = have - n
        return True
    return False


def _free(avail: dict[str, int | None], chip: str, n: int) -> None:
    if avail.get(chip) is not None:
        avail[chip] += n
