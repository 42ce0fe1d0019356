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
* emergency scale-out when a group's peak queue exceeds its total max batch: bypasses the
  doubling limit;
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
from typing import Any, Callable, Mapping

import numpy as np

from dse.db import BestFitDB, Entry
from dse.errors import NeuScaleError
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
    failover: bool = True
    failover_chips: tuple[str, ...] | None = None   # None: every chip version in the DB
    # the chip versions this autoscaler may use at all (§5.4's chip mixes: "C-only", or the
    # "expert choice" of v6e for prefill and v5p for decode); None: every chip in the DB.
    # Best fits are then the best among these chips (SLO-compliant first, then efficiency).
    chips: tuple[str, ...] | None = None
    eviction: bool = True

    def __post_init__(self) -> None:
        if self.growth_per_epoch < 1 or self.shrink_factor < 1:
            raise NeuScaleError("growth_per_epoch and shrink_factor must be >= 1")
        if not 0 < self.ewma_alpha <= 1:
            raise NeuScaleError("ewma_alpha must be in (0, 1]")
        if self.epoch_s <= 0 or self.window_s < self.epoch_s or self.sample_s <= 0:
            raise NeuScaleError("need 0 < sample_s, 0 < epoch_s <= window_s")


@dataclass(frozen=True)
class GroupSpec:
    """A vPod group: one best-fit allocation (every vPod of the group has it, fail-overs aside)."""
    id: str
    chip: str
    topology: str
    num_chips: int
    tp: int
    pp: int
    ep: int
    max_batch: int
    throughput_tok_per_s: float
    best_len: int                    # longest bucket the allocation is the best fit for
    latency_s: float = math.inf      # at best_len and max_batch (TTFT / TPOT)

    @classmethod
    def of(cls, e: Entry) -> "GroupSpec":
        gid = f"{e.chip}:{e.topology}/tp{e.tp}pp{e.pp}ep{e.ep}/b{e.max_batch}"
        return cls(gid, e.chip, e.topology, e.num_chips, e.tp, e.pp, e.ep, e.max_batch,
                   e.throughput_tok_per_s, e.seq_len, e.latency_s)


@dataclass(frozen=True)
class VPod:
    id: str
    group: str
    chip: str
    topology: str
    num_chips: int
    state: str = "ready"             # starting | ready | draining
    failover: bool = False
    throughput_tok_per_s: float = 0.0
    max_batch: int = 0


@dataclass
class Observation:
    now_s: float
    bucket_token_rates: Mapping[int, np.ndarray]   # bucket index -> samples (tokens/s), oldest first
    inventory: list[VPod] = field(default_factory=list)
    group_peak_queue: Mapping[str, int] = field(default_factory=dict)
    available_chips: Mapping[str, int | None] = field(default_factory=dict)  # None: no limit


@dataclass
class GroupState:
    ewma_peak: float = 0.0
    last_shrink_s: float = -math.inf


@dataclass
class PolicyState:
    groups: dict[str, GroupState] = field(default_factory=dict)


@dataclass(frozen=True)
class Action:
    kind: str        # create | delete | replace | create_group | merge_group | evict_group | dse
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
                actions.append(Action("dse", "", f"bucket <= {self.edges[i]} has no best fit: "
                                      f"served by bucket <= {self.edges[j]}, background DSE"))
            g = GroupSpec.of(e)
            specs.setdefault(g.id, g)
            b2g[i] = g.id
        return b2g, specs

    def _latency(self, spec: GroupSpec, i: int) -> float:
        """Latency of ``spec``'s allocation on bucket ``i`` (memoised; see the class doc)."""
        if self.latency_fn is None or spec.tp == 0:
            return spec.latency_s
        key = (spec.id, i)
        v = self._lat_memo.get(key)
        if v is None:
            v = self._lat_memo[key] = float(self.latency_fn(spec, self.phase, self.edges[i]))
        return v

    # ---- the plan -----------------------------------------------------------------------------
    def plan(self, obs: Observation, state: PolicyState | None = None) -> Plan:
        cfg = self.cfg
        state = state or PolicyState()
        actions: list[Action] = []
        n_epoch = max(1, int(round(cfg.epoch_s / cfg.sample_s)))
        n_window = max(1, int(round(cfg.window_s / cfg.sample_s)))
        series = {i: np.asarray(r, dtype=np.float64)[-n_window:]
                  for i, r in obs.bucket_token_rates.items() if len(r) and np.max(r) > 0}
        owned = {v.group for v in obs.inventory if v.state != "draining"}
        if not series and not owned:
            return Plan([], RoutingTable.build({0: "none"}, self.edges), state, {}, {}, {})
        b2g, specs = self._bucket_groups(sorted(series), actions) if series else ({}, {})
        for v in obs.inventory:          # groups that only own vPods are known too
            if v.group not in specs and v.state != "draining":
                specs[v.group] = GroupSpec(v.group, v.chip, v.topology, v.num_chips, 0, 0, 0,
                                           v.max_batch, v.throughput_tok_per_s, 0)
        length = max((len(s) for s in series.values()), default=1)

        def group_series(g: str) -> np.ndarray:
            out = np.zeros(length)
            for i, gid in b2g.items():
                if gid == g:
                    s = series[i]
                    out[length - len(s):] += s
            return out

        for g in sorted(set(b2g.values())):
            if g not in owned:
                actions.append(Action("create_group", g, "best fit of bucket(s) <= " + ", ".join(
                    str(self.edges[i]) for i in sorted(b2g) if b2g[i] == g)))

        # coalescing: merge under-used groups into the next longer one, ascending N_L
        if cfg.coalescing:
            merged = True
            while merged:
                merged = False
                live = sorted(set(b2g.values()))
                nl = {g: group_series(g).max() / specs[g].throughput_tok_per_s for g in live}
                for g in sorted(live, key=nl.get):
                    if nl[g] >= cfg.coalesce_below:
                        break
                    mine = [i for i in b2g if b2g[i] == g]
                    longest = max(mine)
                    # the next longer group (the paper's rule); keeping the SLO, the nearest
                    # longer one whose allocation meets the merged buckets' SLO
                    longer = []
                    for i in sorted(b2g):
                        if i > longest and b2g[i] != g and b2g[i] not in longer:
                            longer.append(b2g[i])
                    if not cfg.coalesce_keep_slo:
                        longer = longer[:1]
                    r_g = group_series(g).max()
                    target, spare = None, 0.0
                    for cand in longer:
                        if cfg.coalesce_keep_slo and not all(
                                self._latency(specs[cand], i) <= self._slo[i] for i in mine):
                            continue
                        r_t = group_series(cand).max()
                        t_t = specs[cand].throughput_tok_per_s
                        spare = max(1, math.ceil(r_t / t_t)) * t_t - r_t
                        if spare >= r_g:
                            target = cand
                            break
                    if target is None:
                        continue
                    for i in b2g:
                        if b2g[i] == g:
                            b2g[i] = target
                    actions.append(Action("merge_group", g, f"N_L={nl[g]:.2f} < "
                                          f"{cfg.coalesce_below}: merged into {target}, "
                                          f"which has {spare:,.0f} tok/s spare"))
                    merged = True
                    break

        avail = {c: (None if n is None else int(n)) for c, n in obs.available_chips.items()}
        inv: dict[str, list[VPod]] = {}
        for v in obs.inventory:
            if v.state != "draining":
                inv.setdefault(v.group, []).append(v)
        live = sorted(set(b2g.values()))
        rates = {g: float(group_series(g).max()) for g in live}
        target: dict[str, int] = {}
        new_state = PolicyState({g: replace(s) for g, s in state.groups.items()})

        # groups that lost all their buckets (merged away or no traffic): evict
        for g in sorted(set(inv) - set(live)):
            for v in inv[g]:
                actions.append(Action("delete", g, "group evicted: no traffic routed to it",
                                      v.chip, v.topology, 1, v.id, v.failover))
                _free(avail, v.chip, v.num_chips)
            actions.append(Action("evict_group", g, "N_pod = 0"))
            new_state.groups.pop(g, None)

        for g in live:
            spec = specs[g]
            s = group_series(g)
            gs = new_state.groups.setdefault(g, GroupState())
            epoch_peak = float(s[-n_epoch:].max())
            gs.ewma_peak = (epoch_peak if gs.ewma_peak == 0.0 else
                            cfg.ewma_alpha * epoch_peak + (1 - cfg.ewma_alpha) * gs.ewma_peak)
            T = spec.throughput_tok_per_s
            current = len(inv.get(g, []))
            r_now = max(epoch_peak, gs.ewma_peak)
            n_pod = math.ceil(r_now / T - 1e-9)
            want, why = current, "steady"
            if n_pod > current:
                cap = max(1, math.floor(current * cfg.growth_per_epoch)) if current else n_pod
                want = min(n_pod, cap)
                why = (f"R_peak {r_now:,.0f} tok/s needs {n_pod} x {T:,.0f}"
                       + (f", capped at x{cfg.growth_per_epoch:g} per epoch" if want < n_pod
                          else ""))
            elif n_pod < current and obs.now_s - gs.last_shrink_s >= cfg.shrink_period_s:
                want = max(n_pod, math.ceil(current / cfg.shrink_factor))
                why = (f"R_peak (EWMA) {r_now:,.0f} tok/s needs {n_pod}"
                       + (f", at most /{cfg.shrink_factor:g} per "
                          f"{cfg.shrink_period_s / 60:g} min" if want > n_pod else ""))
                gs.last_shrink_s = obs.now_s
            queue = obs.group_peak_queue.get(g, 0)
            # batch slots of the group, counting vPods still starting (capacity on its way:
            # without them every epoch of a start-up would order the same vPods again)
            slots = sum(v.max_batch or spec.max_batch for v in inv.get(g, []))
            if cfg.emergency and queue > slots:
                extra = math.ceil((queue - slots) / max(spec.max_batch, 1))
                bound = max(current + 1, math.ceil(current * cfg.emergency_max_factor))
                new = min(current + extra, bound)
                if new > want:
                    want = new
                    why = (f"emergency: peak queue {queue} > {slots} batch slots "
                           "(doubling limit bypassed"
                           + (f", at most x{cfg.emergency_max_factor:g} per epoch)"
                              if new < current + extra else ")"))
            if rates[g] == 0 and queue == 0:
                want, why = 0, "no traffic in the window"
            target[g] = want
            self._actuate(g, spec, want, inv.get(g, []), why, avail, actions, rates, inv)
        routing = RoutingTable.build(b2g or {0: "none"}, self.edges)
        return Plan(actions, routing, new_state, specs, target, rates)

    # ---- actuation under quotas ----------------------------------------------------------------
    def _actuate(self, g: str, spec: GroupSpec, want: int, vpods: list[VPod], why: str,
                 avail: dict[str, int | None], actions: list[Action], rates: dict[str, float],
                 inv: dict[str, list[VPod]]) -> None:
        current = len(vpods)
        if want < current:       # fail-overs first, then starting ones, then the newest
            order = sorted(vpods, key=lambda v: (not v.failover, v.state != "starting"))
            for v in order[:current - want]:
                actions.append(Action("delete", g, why, v.chip, v.topology, 1, v.id, v.failover))
                _free(avail, v.chip, v.num_chips)
            vpods = order[current - want:]
        # replace fail-over vPods by best-fit ones while quota allows
        for v in [v for v in vpods if v.failover]:
            if _take(avail, spec.chip, spec.num_chips):
                actions.append(Action("replace", g, f"best fit {spec.chip} available again",
                                      spec.chip, spec.topology, 1, v.id))
                _free(avail, v.chip, v.num_chips)
        missing = want - min(current, want)
        while missing > 0:
            if _take(avail, spec.chip, spec.num_chips):
                actions.append(Action("create", g, why, spec.chip, spec.topology, 1))
                missing -= 1
                continue
            fo = self._failover(spec, avail) if self.cfg.failover else None
            if fo is not None:
                e, n = fo
                actions.append(Action("create", g, f"{why}; {spec.chip} quota exhausted: "
                                      f"fail-over to {e.chip}", e.chip, e.topology, 1,
                                      failover=True))
                missing -= 1
                continue
            if self.cfg.eviction and self._evict_for(g, spec, avail, actions, rates, inv):
                continue
            actions.append(Action("unsatisfied", g, f"{why}; no quota on any allowed chip",
                                  spec.chip, spec.topology, missing))
            break

    def _failover(self, spec: GroupSpec, avail: dict[str, int | None]):
        i = min(range(len(self.edges)), key=lambda k: abs(self.edges[k] - spec.best_len))
        cands = []
        for c in self.failover_chips:
            if c == spec.chip:
                continue
            e = self._entry(i, c)
            if e is not None:
                cands.append(e)
        cands.sort(key=lambda e: (not e.meets_slo, -e.efficiency))
        for e in cands:
            if _take(avail, e.chip, e.num_chips):
                return e, 1
        return None

    def _evict_for(self, g: str, spec: GroupSpec, avail: dict[str, int | None],
                   actions: list[Action], rates: dict[str, float],
                   inv: dict[str, list[VPod]]) -> bool:
        """Free one vPod of the lowest-R_peak other group that runs on a usable chip."""
        usable = {spec.chip, *(self.failover_chips if self.cfg.failover else [])}
        for other in sorted((o for o in inv if o != g and inv[o]),
                            key=lambda o: rates.get(o, 0.0)):
            if rates.get(other, 0.0) >= rates.get(g, 0.0):
                return False
            for v in inv[other]:
                if v.chip in usable:
                    inv[other].remove(v)
                    _free(avail, v.chip, v.num_chips)
                    actions.append(Action("delete", other, f"evicted for {g} (lowest R_peak "
                                          f"{rates.get(other, 0.0):,.0f} tok/s)", v.chip,
                                          v.topology, 1, v.id, v.failover))
                    return True
        return False


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


class BasePolicy(Policy):
    """The baseline of §5.1: one homogeneous group, the best fit of the longest sequence the
    workload has, scaled in count only (same sizing rules, no coalescing or fail-over)."""

    def __init__(self, db: BestFitDB, phase: str, longest_len: int,
                 config: PolicyConfig = PolicyConfig()):
        super().__init__(db, phase, replace(config, coalescing=False, failover=False))
        i = db.bucket_index(min(int(longest_len), db.edges[-1]))
        while i < len(db.edges) - 1 and self._entry(i) is None:
            i += 1
        e = self._entry(i)
        if e is None:
            raise NeuScaleError(f"no {phase} best fit for the longest sequence ({longest_len})")
        self.spec = GroupSpec.of(e)

    def _bucket_groups(self, buckets, actions):
        return {i: self.spec.id for i in buckets}, {self.spec.id: self.spec}


class MultiPoolPolicy(Policy):
    """The DynamoLLM-like baseline of §5.5: ``K`` fixed pools over equal percentiles of the
    workload's sequence lengths, each the best fit of its longest bucket, scaled in count only
    (no coalescing or fail-over)."""

    def __init__(self, db: BestFitDB, phase: str, lengths, pools: int,
                 config: PolicyConfig = PolicyConfig()):
        super().__init__(db, phase, replace(config, coalescing=False, failover=False))
        if pools < 1:
            raise NeuScaleError(f"multipool needs K >= 1 pools (got {pools})")
        lens = np.minimum(np.asarray(lengths, dtype=np.int64), db.edges[-1])
        if lens.size == 0:
            raise NeuScaleError("multipool needs the workload's lengths")
        cuts = np.quantile(lens, np.linspace(0, 1, pools + 1)[1:])
        self.pool_of: dict[int, GroupSpec] = {}
        lo = 0
        for k, cut in enumerate(cuts):
            hi = db.bucket_index(int(math.ceil(cut)))
            j = hi
            while j < len(db.edges) - 1 and self._entry(j) is None:
                j += 1
            e = self._entry(j)
            if e is None:
                raise NeuScaleError(f"no {phase} best fit for pool {k + 1} (<= {int(cut)})")
            spec = replace(GroupSpec.of(e), id=f"pool{k + 1}:" + GroupSpec.of(e).id)
            for i in range(lo, hi + 1):
                self.pool_of.setdefault(i, spec)
            lo = hi + 1
        last = self.pool_of[max(self.pool_of)]
        for i in range(len(db.edges)):
            self.pool_of.setdefault(i, last)

    def _bucket_groups(self, buckets, actions):
        b2g = {i: self.pool_of[i].id for i in buckets}
        return b2g, {self.pool_of[i].id: self.pool_of[i] for i in buckets}
