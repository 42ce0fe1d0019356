"""Trace-driven cluster simulator (paper §4-5): the policy's second driver, on a virtual clock.

Two pools, prefill and decode (P/D disaggregation, §5.1), each scaled by its own
:class:`orchestrator.policy.Policy` every epoch from an :class:`orchestrator.window.
ObservationWindow` and routed by the pure :mod:`router.routing` table the policy produces (the
live controller uses the same three). Every vPod runs simulated engines (:mod:`sim`) on the
step-cost table of its allocation; a pipeline-parallel vPod runs PP virtual engines, as vLLM
does (:mod:`orchestrator.cluster.fleet`).

Time advances in slices of ``sample_s`` (10 s): life-cycle transitions; arrivals of the slice
are routed (prefill: the vPod of the request's group with an engine free soonest at its
arrival, then the least projected work, :meth:`sim.vpod.VPodEngines.backlog_s`; decode: of
the vPods with a batch slot free at its arrival, the least outstanding tokens,
:func:`router.routing.free_slot_first` on the projected ends of what each vPod's engines
were given, :meth:`sim.vpod.VPodEngines.held_share`) and submitted at their exact arrival times; prefill engines advance to the slice end; finished prefills move
their KV to a decode vPod over DCN and join it when the transfer ends; decode engines advance;
the slice's per-bucket token rates and per-group aggregated queues (its vPods' waiting requests
and its router queue) go into the window. Requests routed to a group with no ready vPod wait at
the router. Every ``epoch_s`` the policies plan, and between epochs a group whose queue is an
emergency gets its scale-out at once (:class:`orchestrator.policy.EmergencyGate`, as the
controller); a plan acts 2-5 s later (Table 3's statistics query) and make-before-break
(:func:`router.routing.make_before_break`).

Output-length prediction (§5.1): with probability ``accuracy`` a request is routed to the decode
group of its true total length, else to a random group whose best-fit length is not shorter.
With a :class:`Confusion` (``orchestrator simulate --predictor MODEL_DIR``) the prediction is
drawn instead from a real predictor's confusion matrix measured on held-out prompts.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from dse.catalog import Catalog, default_catalog
from dse.db import BestFitDB
from dse.errors import NeuScaleError
from dse.models import ModelArch
from dse.vpod import VPodState
from router.routing import (MIGRATE_FACTOR, RoutingTable, bucket_indices, free_slot_first,
                            handing_over, make_before_break, ready_group, should_migrate)
from sim.lifecycle import STATS_QUERY_S
from sim.stepcost import StepCostTable
from sim.vpod import TableCache, engine_batch

from ..policy import (Action, ActionKind, EmergencyGate, Plan, Policy, PolicyConfig, PolicyState,
                      VPodRecord)
from ..window import ObservationWindow, chips_in_use
from .accounting import Migration, SimResult, bin_minutes, phase_reports
from .fleet import Alloc, Fleet, SimVPod, load, soonest

PHASES = ("prefill", "decode")


@dataclass(frozen=True, eq=False)
class Confusion:
    """A predictor's measured confusion over output-length buckets, replayed per request.

    ``counts[t, j]``: held-out answers of output bucket ``t`` the predictor put in bucket ``j``
    (bucket ``k`` holds lengths in ``(edges[k-1], edges[k]]``). A request of true output bucket
    ``t`` is predicted bucket ``j`` with probability ``counts[t, j] / sum_j counts[t, j]``; a
    bucket no held-out answer fell in borrows the row of the nearest one that has answers,
    shifted by the distance (an answer one bucket longer is predicted one bucket longer: the
    error in buckets is what carries over). The predicted length is ``rep_tokens[j]`` (the
    training answers' median in that bucket, else its middle). A re-prediction after ``g``
    generated tokens draws from the same row restricted to buckets ending above ``g``, as the
    predictor's own conditional median does; nothing left there means it says nothing beyond
    the current length."""
    edges: tuple[int, ...]
    counts: np.ndarray
    rep_tokens: np.ndarray
    label: str = ""

    @classmethod
    def from_counts(cls, edges, counts, bucket_median=None, label: str = "") -> "Confusion":
        edges = tuple(int(e) for e in edges)
        K = len(edges)
        c = np.asarray(counts, dtype=np.float64)
        if c.shape != (K, K) or not np.isfinite(c).all() or (c < 0).any() or c.sum() <= 0:
            raise NeuScaleError(f"a confusion matrix must be {K}x{K} non-negative counts with "
                                "at least one answer")
        have = np.nonzero(c.sum(axis=1) > 0)[0]
        rows = np.zeros_like(c)
        for t in range(K):
            r = have[np.argmin(np.abs(have - t))]
            shift = t - r
            for j in np.nonzero(c[r])[0]:
                rows[t, min(max(j + shift, 0), K - 1)] += c[r, j]
        lo = np.array([0.0, *edges[:-1]])
        hi = np.array(edges, dtype=np.float64)
        rep = np.floor((lo + hi) / 2.0) + 1.0
        if bucket_median is not None:
            med = np.asarray(bucket_median, dtype=np.float64)
            ok = np.isfinite(med) & (med > lo) & (med <= hi)
            rep[ok] = np.round(med[ok])
        return cls(edges, rows / rows.sum(axis=1, keepdims=True), rep, label)

    def draw(self, out: int, u: float, above: int = 0) -> int | None:
        """Predicted output tokens for a request of ``out`` output tokens (``u`` uniform), given
        more than ``above`` generated; None when the row has no bucket ending above it."""
        t = min(bisect_left(self.edges, max(1, out)), len(self.edges) - 1)
        row = self.counts[t]
        if above > 0:
            k0 = bisect_left(self.edges, above + 1)
            if k0 >= len(row):
                return None
            tail = row[k0:]
            tot = tail.sum()
            if tot <= 0:
                return None
            j = k0 + min(int(np.searchsorted(np.cumsum(tail), u * tot, side="right")),
                         len(tail) - 1)
            return max(int(self.rep_tokens[j]), above + 1)
        j = min(int(np.searchsorted(np.cumsum(row), u * row.sum(), side="right")), len(row) - 1)
        return int(self.rep_tokens[j])


@dataclass(frozen=True)
class ClusterConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    accuracy: float = 0.6        # §5.1: output-length prediction accuracy
    confusion: Confusion | None = None   # a real predictor's measured confusion (replaces it)
    quotas: Mapping[str, int] = field(default_factory=dict)   # chips per version; absent: no limit
    seed: int = 0
    max_batched_tokens: int = 8192
    warm_start: bool = True      # first plan at t=0 from the trace's first epoch
    cache_tables: bool = True    # keep step-cost tables on disk (next to the XLA-fit cache)
    make_before_break: bool = True   # off: route to a new group as soon as it is planned
    # The decode load the policy observes: where the router sent it (True: a mispredicted
    # request's tokens count at the length its group serves, as the live gateway, which knows
    # only the prediction, counts them) or at the request's true length (False: how this
    # simulator observed before the load-aware policy; the golden outputs use it).
    observe_routed: bool = True
    # Refuse traces longer than this: each simulated 10 s costs a loop iteration whether or not
    # anything happens (a week: the longest real trace we know, the 2024 Azure week).
    max_span_s: float = 7 * 86400.0


class _Requests:
    """The trace in arrival order, as Python lists for per-request scalar access, and what
    happens to each request."""

    def __init__(self, db: BestFitDB, arrival_s, input_tokens, output_tokens):
        n = len(arrival_s)
        if n == 0:
            raise NeuScaleError("the trace has no requests")
        order = np.argsort(arrival_s, kind="stable")
        self.arr = np.asarray(arrival_s, np.float64)[order]
        self.inp = np.asarray(input_tokens, np.int64)[order]
        self.out = np.asarray(output_tokens, np.int64)[order]
        if (self.inp < 1).any() or (self.out < 1).any():
            raise NeuScaleError("every request needs >= 1 input and >= 1 output token")
        self.pre_bucket = bucket_indices(db.edges, self.inp)
        self.tot_bucket = bucket_indices(db.edges, self.inp + self.out)
        # longer than the largest bucket: no allocation of the DB holds it. Dropped on
        # arrival (never served, an SLO miss in both phases) and kept out of the load the
        # policy sees, so it drives no scaling.
        longest = db.edges[-1]
        self.servable = (self.inp <= longest) & ((self.out <= 1) |
                                                 (self.inp + self.out <= longest))
        self.servable_l = self.servable.tolist()
        self.slo_p = np.asarray(db.meta["slo_s"]["prefill"])[self.pre_bucket]
        self.slo_d = np.asarray(db.meta["slo_s"]["decode"])[self.tot_bucket]
        self.arr_l, self.inp_l, self.out_l = self.arr.tolist(), self.inp.tolist(), self.out.tolist()
        self.pb, self.tb = self.pre_bucket.tolist(), self.tot_bucket.tolist()
        self.ttft = np.full(n, np.nan)
        self.tpot = np.full(n, np.nan)
        self.dec_start = np.full(n, np.nan)      # first decode token available
        self.dec_end = np.full(n, np.nan)
        # each request's share of the energy of the engine steps it was in (Fig. 19c)
        self.energy_j = {"prefill": np.zeros(n), "decode": np.zeros(n)}


class ClusterSim:
    def __init__(self, arch: ModelArch, db: BestFitDB, policies: Mapping[str, Policy],
                 config: ClusterConfig = ClusterConfig(), catalog: Catalog | None = None):
        self.arch, self.db, self.cfg = arch, db, config
        self.catalog = catalog or default_catalog()
        self.policies = dict(policies)
        for pol in self.policies.values():     # the coalescing SLO check asks the chip model
            if getattr(pol, "latency_fn", False) is None:
                pol.latency_fn = self.latency_of
        self.rng = np.random.default_rng(config.seed)
        self.tables = TableCache(arch, self.catalog, on_disk=config.cache_tables,
                                 stack=db.stack)
        self.fleet = Fleet(arch, self.catalog, self.rng, self.table, config.max_batched_tokens)
        self._kv_bytes = arch.kv_bytes_per_token()
        self._draws: list[float] = []

    # ---- allocations --------------------------------------------------------------------------
    def table(self, alloc: Alloc) -> StepCostTable:
        return self.tables(alloc)

    def latency_of(self, spec, phase: str, length: int) -> float:
        """TTFT (prefill: a virtual engine's full batch of ``length``-token prompts in one step)
        or TPOT (decode: its full batch at KV ``length``) of a group's allocation on the chip
        model: the policy's latency oracle."""
        e = spec.entry
        t = self.table(e.alloc_key)
        b, n = float(engine_batch(e.max_batch, e.pp)), float(length)
        if phase == "prefill":
            return t.step1(b * n, b * n * (n + 1) / 2, 0.0, 0.0)[0]
        return t.step1(0.0, 0.0, b, b * n)[0]

    # ---- run ----------------------------------------------------------------------------------
    def run(self, arrival_s: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray,
            progress: Callable[[float], None] | None = None) -> SimResult:
        self.req = req = _Requests(self.db, arrival_s, input_tokens, output_tokens)
        span_s = float(req.arr[-1])
        if span_s > self.cfg.max_span_s:
            raise NeuScaleError(
                f"the trace spans {span_s / 86400:,.1f} days, more than the "
                f"{self.cfg.max_span_s / 86400:g}-day limit (every simulated 10 s costs a "
                "step): cut a window (--start, --hours), check --rate-scale, or raise --max-span")
        self._start(req)
        if self.cfg.warm_start:
            self._warm_start(req)
        end = float(req.arr[-1]) + 1.0
        t, i, k = 0.0, 0, 0
        while t < end or self._busy():
            t_next = t + self.dt
            self.fleet.advance(t_next)
            self._route_tables(t_next)
            i = self._arrivals(i, t_next)
            self._flush()
            self._advance_engines(t_next)
            self._sample()
            k += 1
            t = t_next
            if k % self._minute_every == 0:
                self._snapshot(t)
            # a controller that starts cold plans as soon as it has seen traffic
            if (k % self._epoch_every == 0 and t < end) or \
                    (self._unrouted and self._routing["prefill"] is None):
                self._epoch(t)
                self._route_unrouted()
            elif t < end:
                self._emergencies(t)
            if progress:
                progress(t)
            if t > end + 86400:
                raise NeuScaleError("simulation does not drain: requests larger than any vPod?")
        return self._result(t)

    def _start(self, req: _Requests) -> None:
        pcfg = self.cfg.policy
        self.dt = pcfg.sample_s
        nb = len(self.db.edges)
        self.window = ObservationWindow(nb, pcfg)
        self._epoch_every = self.window.epoch_samples
        self._minute_every = max(1, int(round(60.0 / self.dt)))
        self._cur_p = np.zeros(nb)
        self._cur_d = [0.0] * nb
        self._states = {ph: PolicyState() for ph in PHASES}
        self._gate = EmergencyGate()
        self.emergency_plans = 0     # plans between epochs
        self._routing: dict[str, RoutingTable | None] = {"prefill": None, "decode": None}
        self._planned: dict[str, RoutingTable | None] = {"prefill": None, "decode": None}
        self._held: dict[str, float] = {}     # deleted vPods of groups still handing over
        self._cands: list = []
        self._router_q: dict[tuple[str, str], list] = {}
        self._unrouted: list[int] = []
        self._segments: dict[int, list] = {}
        self.migrations: list[Migration] = []
        self.timeline: list[dict[str, Any]] = []
        self.minutes: list[dict[str, Any]] = []
        self._last_energy: dict[str, float] = {}

    def _warm_start(self, req: _Requests) -> None:
        """The first plan sees the trace's first epoch (a running service): its vPods are
        already up at t = 0. The window holds the epoch's prefill samples as a running
        service's would (each 10 s of it, peaks included: a prompt's stay is shorter than a
        sample, so the policy sizes on their peak); decode is primed at the epoch's mean
        rates, as the decode load averaged over its requests' stays (their stays are not
        known before they finish, and the raw samples' peak counts the Poisson noise of long
        answers that the stay-averaged load does not)."""
        epoch_s = self.cfg.policy.epoch_s
        first = (req.arr < epoch_s) & req.servable
        nb = len(self.db.edges)
        rates = {ph: np.bincount(b[first], weights=tok[first], minlength=nb) / epoch_s
                 for ph, b, tok in (("prefill", req.pre_bucket, req.inp),
                                    ("decode", req.tot_bucket, req.out))}
        if self.cfg.observe_routed and "decode" in self.policies:
            rates["decode"] = self._routed_decode_rates(req, first, rates)
        n, dt = self._epoch_every, self.dt
        k = np.minimum((req.arr[first] / dt).astype(np.int64), n - 1)
        samples = np.bincount(k * nb + req.pre_bucket[first], weights=req.inp[first],
                              minlength=n * nb).reshape(n, nb) / dt
        for x in samples:
            self.window.record("prefill", x)
        self.window.prime("decode", rates["decode"], n)
        self._epoch(0.0, warm=True)
        for v in self.fleet.vpods.values():
            v.created_s -= v.ready_s     # already running at t = 0
            v.ready_s = 0.0

    def _routed_decode_rates(self, req: _Requests, first: np.ndarray,
                             rates: dict[str, np.ndarray]) -> np.ndarray:
        """The first epoch's decode load as the running service's window would hold it: at
        the lengths its groups are routed (:meth:`_observe_decode`), not the true ones. A
        mispredicted answer goes to any group whose length is not shorter, so a group serving
        the longest lengths is sent far more than its true share (DeepSeek-V3 at 16x the
        Azure load: a 10 K-token group primed at its true 34 tok/s was sent ~1,100). The
        decode plan on the true lengths gives the routing; the first epoch's requests are
        routed through it, and nothing of this dry plan is kept."""
        nb = len(self.db.edges)
        dry = ObservationWindow(nb, self.cfg.policy)
        dry.prime("decode", rates["decode"], self._epoch_every)
        obs = dry.observe("decode", 0.0, [], self.cfg.quotas, {})
        table = self.policies["decode"].plan(obs, PolicyState()).routing
        self._routing["decode"] = table
        self._cands = sorted((table.best_len.get(g, 0), g) for g in set(table.groups))
        self._cur_d = [0.0] * nb
        for r in np.flatnonzero(first & (req.out > 1)):
            y = int(req.out_l[r])
            self._observe_decode(int(req.tb[r]), y, self._decode_segments(int(req.inp_l[r]), y))
        out = np.asarray(self._cur_d) / self.cfg.policy.epoch_s
        self._routing["decode"], self._cands, self._cur_d = None, [], [0.0] * nb
        return out

    def _busy(self) -> bool:
        """Engines still working, or requests queued at the router for a group whose vPods are
        still starting (after the trace ends, the run waits for them; requests for a group that
        gets no vPod at all, e.g. no quota and no fail-over chip, are never served and count
        as dropped)."""
        if any(v.engine is not None and not v.engine.idle for v in self.fleet.active):
            return True
        starting = self.fleet.starting_groups()
        return any(lst and key in starting for key, lst in self._router_q.items())

    def _arrivals(self, i: int, t_next: float) -> int:
        """Route the slice's arrivals to prefill; returns the index of the next arrival."""
        req = self.req
        j = int(np.searchsorted(req.arr, t_next, side="left"))
        self._cur_p = np.bincount(req.pre_bucket[i:j], weights=req.inp[i:j] * req.servable[i:j],
                                  minlength=len(self.db.edges))
        ok = req.servable_l
        table = self._routing["prefill"]
        if table is None:                 # cold start: nothing planned yet
            self._unrouted.extend(r for r in range(i, j) if ok[r])
        else:
            groups, pb, arr_l, inp_l = table.groups, req.pb, req.arr_l, req.inp_l
            for r in range(i, j):
                if ok[r]:
                    self._submit("prefill", groups[pb[r]], r, arr_l[r], inp_l[r], 1)
        return j

    def _route_unrouted(self) -> None:
        table, req = self._routing["prefill"], self.req
        for r in self._unrouted:
            self._submit("prefill", table.groups[req.pb[r]], r, req.arr_l[r], req.inp_l[r], 1)
        self._unrouted = []

    def _advance_engines(self, t_next: float) -> None:
        """Prefill first (its hand-offs feed decode), then decode. The slice's hand-offs reach
        the decode vPods in the order they happen, as a live router sees them: the engines'
        loads are only updated at a slice's end, and hand-offs given vPod after vPod (each
        prefill vPod's spanning the whole slice) would pile onto the same decode virtual
        engines (DeepSeek-V3 on v5e-128 PP16 at a quarter of its slots: 18 % of answers
        waited behind another one; 0.6 % in time order)."""
        active = self.fleet.active
        handoffs: list[tuple] = []
        for v in active:
            if v.engine is not None and v.phase == "prefill":
                self._prefill_done(v, v.engine.advance_to(t_next), handoffs)
        handoffs.sort(key=lambda h: h[2])
        for g, r, at_s, inp, out in handoffs:
            self._submit("decode", g, r, at_s, inp, out)
        for v in active:
            if v.engine is not None and v.phase == "decode":
                self._decode_done(v, v.engine.advance_to(t_next))

    def _sample(self) -> None:
        """The slice's token rates per bucket and the queues per group, into the window."""
        w, dt = self.window, self.dt
        w.record("prefill", self._cur_p / dt)
        w.record("decode", np.asarray(self._cur_d) / dt)
        self._cur_d = [0.0] * len(self.db.edges)
        queue: dict[tuple[str, str], int] = {}    # a group's aggregated queue (§3.4)
        for v in self.fleet.active:
            if v.engine is not None and v.engine.num_waiting:
                key = (v.phase, v.group)
                queue[key] = queue.get(key, 0) + v.engine.num_waiting
        for key, lst in self._router_q.items():
            if lst:
                queue[key] = queue.get(key, 0) + len(lst)
        for (ph, g), n in queue.items():
            w.note_queue(ph, g, n)

    # ---- requests -----------------------------------------------------------------------------
    def _prefill_done(self, v: SimVPod, done: list, handoffs: list) -> None:
        """Prefilled requests: TTFT, then (output > 1) their KV goes to a decode vPod: the
        hand-off ``(group, request, arrival, prompt, output)`` is appended to ``handoffs``."""
        req = self.req
        ttft, tpot, inp_l, out_l, arr_l = req.ttft, req.tpot, req.inp_l, req.out_l, req.arr_l
        e_pre = req.energy_j["prefill"]
        ready_by = self.fleet.ready_by
        if done:
            self.window.note_duration("prefill", v.group,
                                      max(q.finish_s - q.arrival_s for q in done))
            pb = req.pb                     # each prompt's time on the vPod, at its bucket
            self._note_stays("prefill", ((pb[q.req_id], q.finish_s - q.arrival_s)
                                         for q in done))
        for q in done:
            r = q.req_id
            x, y = inp_l[r], out_l[r]
            v.outstanding -= x
            ttft[r] = q.finish_s - arr_l[r]
            e_pre[r] = q.energy_j
            if y <= 1:
                tpot[r] = 0.0
                continue
            segs = self._decode_segments(x, y)
            self._observe_decode(req.tb[r], y, segs)     # where the prediction sends it
            if not ready_by.get(("decode", segs[0][0])):   # its group has nothing up yet
                alt = ready_group(self._routing["decode"], segs[0][0], x + 1,
                                  lambda g: bool(ready_by.get(("decode", g))))
                if alt is not None:
                    segs = self._path(alt, x, y)
            at = q.finish_s + v.kv_transfer_s(x, self._kv_bytes)
            req.dec_start[r] = at
            g, m_end = segs[0]
            if len(segs) > 1:
                self._segments[r] = segs
            handoffs.append((g, r, at, x, m_end))

    def _observe_decode(self, true_bucket: int, out: int, segs: list) -> None:
        """A decoding request's tokens into this slice's load: each segment's tokens at the
        request's bucket if its group serves that bucket, else at the length the group is
        routed (its best-fit bucket): the load a group is sent is the load it is sized for."""
        table = self._routing["decode"]
        if not self.cfg.observe_routed or table is None:
            self._cur_d[true_bucket] += out
            return
        prev = 0
        for g, m_end in segs:
            b = true_bucket if table.groups[true_bucket] == g else \
                table.bucket(table.best_len.get(g, table.edges[true_bucket]))
            self._cur_d[b] += m_end - prev
            prev = m_end

    def _decode_done(self, v: SimVPod, done: list) -> None:
        """Finished decode segments: the request's next segment (a migration), or its TPOT."""
        req = self.req
        e_dec = req.energy_j["decode"]
        if done:                                  # how long this group's vPods take to drain
            self.window.note_duration("decode", v.group,
                                      max(q.finish_s - q.arrival_s for q in done))
            self._note_stays("decode", self._decode_stays(v.group, done))
        for q in done:
            r = q.req_id
            v.outstanding -= q.output_tokens
            e_dec[r] += q.energy_j
            segs = self._segments.get(r)
            if segs is not None and len(segs) > 1:
                m0 = segs[0][1]                   # tokens generated when it leaves
                segs.pop(0)
                g, m1 = segs[0]
                kv = req.inp_l[r] + m0 - 1
                self.migrations.append(Migration(r, v.group, g, kv + 1, q.finish_s))
                self._submit("decode", g, r, q.finish_s + v.kv_transfer_s(kv, self._kv_bytes),
                             kv, m1 - m0 + 1)
                continue
            self._segments.pop(r, None)
            req.tpot[r] = (q.finish_s - req.dec_start[r]) / (req.out_l[r] - 1)
            req.dec_end[r] = q.finish_s

    def _note_stays(self, phase: str, stays) -> None:
        """(bucket, seconds on a vPod) per finished request, into the window."""
        note = self.window.note_stay
        for b, x in stays:
            note(phase, int(b), x)

    def _decode_stays(self, g: str, done: list):
        """Each finished segment's time on a vPod of ``g``, at the bucket its tokens were
        counted at (:meth:`_observe_decode`)."""
        table, tb = self._routing["decode"], self.req.tb
        own = None
        if self.cfg.observe_routed and table is not None and g in table.best_len:
            own = table.bucket(table.best_len[g])
        for q in done:
            b = tb[q.req_id]
            if own is not None and table.groups[b] != g:
                b = own
            yield b, q.finish_s - q.arrival_s

    def _draw(self) -> float:
        """A uniform for a routing decision (drawn in blocks of 4096)."""
        u = self._draws
        if not u:
            u.extend(self.rng.random(4096).tolist())
        return u.pop()

    def _decode_segments(self, inp: int, out: int) -> list[tuple[str, int]]:
        """Where a request decodes: [(group, tokens generated when it leaves), ...].

        The output length is predicted right with probability ``accuracy`` (§5.1), else the
        request goes to a random group whose best-fit length is not shorter than its current
        length. At every bucket boundary the remaining length is re-predicted (right with the
        same probability; a wrong estimate is taken to say nothing beyond the current length)
        and the router's migration rule (:func:`router.routing.should_migrate`) may move it on
        (§3.4). The prediction's path: at the hand-off a request whose group has nothing up
        starts on a ready group that holds it (:func:`router.routing.ready_group`,
        :meth:`_prefill_done`), while its load is counted where the prediction sent it (as
        the gateway counts it, at admission)."""
        table = self._routing["decode"]
        total = inp + out
        g = table.group_for_length(total)
        acc = self.cfg.accuracy
        conf = self.cfg.confusion
        if conf is not None:
            g = table.group_for_length(inp + conf.draw(out, self._draw()))
        elif self._draw() >= acc:
            cands = self._cands
            lo = bisect_left(cands, (inp + 1,))
            if lo < len(cands):
                g = cands[lo + min(int(self._draw() * (len(cands) - lo)), len(cands) - lo - 1)][1]
        return self._path(g, inp, out)

    def _path(self, g, inp: int, out: int) -> list[tuple[str, int]]:
        """:meth:`_decode_segments`' path from group ``g`` on: the migrations (§3.4) at the
        bucket boundaries where the re-predicted length passes twice the group's length."""
        table = self._routing["decode"]
        total = inp + out
        acc = self.cfg.accuracy
        conf = self.cfg.confusion
        if total <= MIGRATE_FACTOR * table.best_len.get(g, 0):   # nothing can pass 2x
            return [(g, out)]
        segs = []
        length = table.next_boundary(inp + 1)      # it decodes from inp + 1 tokens on
        while length is not None and length < total:          # enters the next bucket
            if conf is not None:
                e = conf.draw(out, self.rng.random(), above=length - inp)
                est = length if e is None else max(inp + e, length + 1)
            else:
                est = total if self.rng.random() < acc else length
            tgt = should_migrate(table, g, length, est)
            if tgt is not None and tgt != g:
                segs.append((g, length - inp))
                g = tgt
                if total <= MIGRATE_FACTOR * table.best_len.get(g, 0):
                    break
            length = table.next_boundary(length)
        segs.append((g, out))
        return segs

    def _submit(self, phase: str, group: str, r: int, at_s: float, inp: int, out: int) -> None:
        vs = self.fleet.ready_by.get((phase, group))
        if not vs:
            self._router_q.setdefault((phase, group), []).append((at_s, r, inp, out))
            return
        if len(vs) == 1:
            v = vs[0]
        elif phase == "prefill":
            # the vPod with an engine free soonest at this arrival, then the least work (the
            # live gateway counts each vPod's in-flight work as it goes; the outstanding count
            # below learns of finishes only at a slice's end, which made it round-robin)
            v = soonest(vs, at_s)
        else:
            v = free_slot_first(vs, lambda x: x.engine.held_share(at_s), load)
        tokens = inp if phase == "prefill" else out
        v.outstanding += tokens
        try:
            v.engine.submit(r, at_s, inp, out)
        except ValueError:      # larger than this vPod's KV cache: dropped (an SLO miss)
            v.outstanding -= tokens

    def _flush(self) -> None:
        """Requests parked at the router go to their group once it has a ready vPod."""
        rq = self._router_q
        for (ph, g), lst in list(rq.items()):
            if lst and self.fleet.ready_by.get((ph, g)):
                rq[(ph, g)] = []
                for at_s, r, inp, out in lst:
                    self._submit(ph, g, r, at_s, inp, out)

    # ---- epochs: observe, plan, act -----------------------------------------------------------
    def _epoch(self, now: float, warm: bool = False) -> None:
        # the statistics are read at ``now``; the controller gets them 2-5 s later (Table 3)
        # and its actions start then (the plan itself takes milliseconds)
        act = now if warm else now + float(self.rng.uniform(*STATS_QUERY_S))
        self._gate.new_epoch()
        for ph, pol in self.policies.items():
            inv = self._inventory(ph)
            urgent = self._gate.due(ph, pol, self.window.peak_queue[ph], inv, at_epoch=True)
            plan = pol.plan(self._observe(ph, inv, now), self._states[ph])
            self._states[ph] = plan.state
            self._planned[ph] = plan.routing
            self._act(ph, plan, act)
            self._gate.acted(ph, urgent, self._inventory(ph))
            self.timeline.append({"t_s": now, "phase": ph, "target": dict(plan.target),
                                  "actions": len(plan.actions),
                                  "lengths": _lengths_served(plan.routing)})
        self.window.end_epoch()
        self.fleet.index_ready()
        self._route_tables(now)

    def _emergencies(self, now: float) -> None:
        """Between epochs: a group whose aggregated queue is an emergency gets its scale-out
        now (§3.4 bypasses the epoch; :class:`orchestrator.policy.EmergencyGate`, as the
        controller)."""
        qs = self.window.queue_now
        for ph, pol in self.policies.items():
            if not qs[ph]:
                continue
            inv = self._inventory(ph)
            urgent = self._gate.due(ph, pol, qs[ph], inv)
            if not urgent:
                continue
            plan = pol.plan_emergency(self._observe(ph, inv, now, epoch=False),
                                      self._states[ph], urgent)
            self._states[ph] = plan.state
            self._act(ph, plan, now + float(self.rng.uniform(*STATS_QUERY_S)))
            self._gate.acted(ph, urgent, self._inventory(ph))
            self.emergency_plans += 1

    def _observe(self, phase: str, inv: list[VPodRecord], now: float, epoch: bool = True):
        return self.window.observe(phase, now, inv, self.cfg.quotas,
                                   chips_in_use(self.fleet.chips_held()), epoch)

    def _inventory(self, phase: str) -> list[VPodRecord]:
        """What the policy sees of ``phase``: every vPod starting or ready, not being deleted."""
        return [VPodRecord(v.id, v.group, v.chip, v.topology, v.num_chips, v.state, v.failover,
                           v.throughput_tok_per_s, v.max_batch)
                for v in self.fleet.active if v.phase == phase and v.delete_at_s is None
                and v.state in (VPodState.STARTING, VPodState.READY)]

    def _act(self, phase: str, plan: Plan, at_s: float) -> None:
        """Carry out a plan's vPod actions from ``at_s`` on."""
        fleet = self.fleet
        for a in plan.actions:
            if a.kind == ActionKind.CREATE:
                self._create(phase, a, at_s, plan.groups[a.group].entry)
            elif a.kind == ActionKind.DELETE and a.vpod_id in fleet.vpods:
                v = fleet.vpods[a.vpod_id]
                if v.state == VPodState.READY:    # make before break: _route_tables releases
                    self._held.setdefault(v.id, at_s)   # it once its group hands nothing over
                else:
                    fleet.release(v, at_s)
            elif a.kind == ActionKind.REPLACE and a.vpod_id in fleet.vpods:
                e = plan.groups[a.group].entry
                self._create(phase, Action(ActionKind.CREATE, a.group, a.reason, e.chip,
                                           e.topology, 1), at_s, e)
                fleet.release(fleet.vpods[a.vpod_id], at_s)

    def _create(self, phase: str, a: Action, at_s: float, best) -> None:
        """One vPod of ``a``'s group: the group's best fit, or (fail-over) the DB entry of the
        action's chip and topology."""
        e = self._entry_for(phase, a.chip, a.topology) if a.failover else best
        self.fleet.create(phase, a.group, a.chip, a.topology, e.parallelism,
                          e.max_batch, e.throughput_tok_per_s, at_s, a.failover)

    def _entry_for(self, phase: str, chip: str, topology: str):
        for e in self.db.entries:
            if e.phase == phase and e.chip == chip and e.topology == topology and e.feasible:
                return e
        return None

    def _route_tables(self, now: float) -> None:
        """The tables the router uses: each phase's planned table, with buckets whose new
        group is not up yet (no ready vPod, or some still starting) left on their old group
        (router.routing.make_before_break);
        a deleted vPod is released once its group hands no bucket over (evicted groups once
        nothing routes to them; router.routing.handing_over)."""
        ready_by = self.fleet.ready_by
        starting = self.fleet.starting_groups() if self.cfg.make_before_break else set()
        for ph, planned in self._planned.items():
            if planned is None:
                continue
            old = self._routing[ph]
            eff = planned if not self.cfg.make_before_break else make_before_break(
                planned, old, lambda g, ph=ph: bool(ready_by.get((ph, g)))
                and (ph, g) not in starting)
            if eff is not old:
                self._routing[ph] = eff
                if ph == "decode":     # mis-predicted requests pick among these (by length)
                    self._cands = sorted((eff.best_len.get(g, 0), g) for g in set(eff.groups))
        if self._held:
            giving = {(ph, g) for ph, t in self._routing.items()
                      for g in handing_over(t, self._planned.get(ph))}
            for vid in list(self._held):
                v = self.fleet.vpods[vid]
                if (v.phase, v.group) not in giving or \
                        v.state not in (VPodState.STARTING, VPodState.READY):
                    self.fleet.release(v, max(self._held.pop(vid), now))

    # ---- accounting ---------------------------------------------------------------------------
    def _snapshot(self, t: float) -> None:
        """One row per minute and phase: vPods per group (ready) and the energy used in the
        minute (engines' energy up to their clocks); requests finished in the minute and the
        share that met the SLO are added from the finish times at the end."""
        for ph in PHASES:
            groups = self.fleet.ready_per_group(ph)
            energy = self.fleet.phase_energy_j(ph, t)
            prev = self._last_energy.get(ph, 0.0)
            self._last_energy[ph] = energy
            self.minutes.append({"t_s": t, "phase": ph, "vpods": groups,
                                 "energy_j": energy - prev})

    def _result(self, t_end: float) -> SimResult:
        req = self.req
        reports = phase_reports(self.fleet, t_end, req.arr, req.inp, req.out, req.ttft,
                                req.tpot, req.slo_p, req.slo_d, len(self.migrations))
        multi = req.out > 1
        bin_minutes(self.minutes, {"prefill": req.arr + req.ttft, "decode": req.dec_end},
                    {"prefill": req.ttft <= req.slo_p,
                     "decode": (req.tpot <= req.slo_d) & multi})
        return SimResult(reports, req.arr, req.inp, req.out, req.ttft, req.tpot, req.energy_j,
                         self.timeline, self.minutes, self.migrations,
                         list(self.fleet.vpods.values()), t_end)


def _lengths_served(t) -> dict[str, tuple[int, int]]:
    """Group -> (shortest, longest) length it is routed (bucket edges; a length in
    ``(previous edge, edge]`` goes to the bucket of ``edge``)."""
    out: dict[str, tuple[int, int]] = {}
    lo = 1
    for e, g in zip(t.edges, t.groups):
        a, b = out.get(g, (lo, e))
        out[g] = (min(a, lo), max(b, e))
        lo = e + 1
    return out
