"""Trace-driven cluster simulator (paper §4-5): the production policy and routing code driving
simulated engines in virtual time.

Two pools, prefill and decode (P/D disaggregation, §5.1), each scaled by its own
:class:`orchestrator.policy.Policy` every epoch and routed by the pure
:class:`router.routing.RoutingTable` it produces. Every vPod runs a :class:`sim.engine.Engine`
on the :class:`sim.stepcost.StepCostTable` of its allocation (the chip model's clock); a
pipeline-parallel vPod runs PP virtual engines, as vLLM does, so its throughput is the pipelined
one the DSE assumes.

Time advances in slices of ``sample_s`` (10 s): arrivals of the slice are routed (least-loaded
vPod of the request's group, by outstanding tokens) and submitted at their exact arrival times;
prefill engines advance to the slice end; finished prefills move their KV to a decode vPod over
DCN (latency + bytes / the slower chip's DCN bandwidth) and join it at the exact time the
transfer ends; decode engines advance; the slice's per-bucket token rates and per-group queues
are sampled for the policy. Requests routed to a group with no ready vPod wait at the router.

vPod life cycle (paper Table 3): create 73-108 s, engine start 31 s, weight download of the
chip's shard at its DCN bandwidth, weight load at 24 GB/s per chip; then ready. Deletion: the
vPod stops taking requests, drains, and is released 15 s later. Static power is paid from
creation to release; dollars for every chip-second held.

Output-length prediction (§5.1): with probability ``accuracy`` a request is routed to the decode
group of its true total length, else to a random group whose best-fit length is not shorter.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from dse.catalog import Catalog, default_catalog
from dse.costmodel import Parallelism, max_weights_bytes
from dse.db import BestFitDB
from dse.errors import NeuScaleError
from dse.models import ModelArch
from dse.vpod import ICITopology
from orchestrator.policy import Action, Observation, Policy, PolicyConfig, PolicyState, VPod
from router.routing import MIGRATE_FACTOR, RoutingTable, make_before_break, should_migrate

from .chip import ChipModel
from .fastengine import DecodeEngine, PrefillEngine
from .stepcost import PipelineShare, StepCostTable

CREATE_S = (73.0, 108.0)        # Table 3: create a vPod instance
DELETE_S = 15.0                 # Table 3: delete a vPod instance
ENGINE_START_S = 31.0           # Table 3: NPU runtime and serving engine start-up
LOAD_BW_BYTES_PER_S = 24e9      # Table 3: load weights to the chips, per chip (PCIe 4.0 x16)
DCN_LATENCY_S = 1e-3            # per KV transfer between vPods (order of Fig. 13's small sizes)
STATS_QUERY_S = (2.0, 5.0)      # Table 3: query vPod runtime statistics (a plan acts this late)


@dataclass(frozen=True)
class ClusterConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    accuracy: float = 0.6
    quotas: Mapping[str, int] = field(default_factory=dict)     # chips per version (absent: no limit)
    seed: int = 0
    max_batched_tokens: int = 8192
    warm_start: bool = True      # first plan at t=0 from the trace's first epoch
    cache_tables: bool = True    # keep step-cost tables on disk (next to the XLA-fit cache)
    make_before_break: bool = True   # off: route to a new group as soon as it is planned


class VPodEngines:
    """The engines of one vPod: one, or ``pp`` pipeline virtual engines (vLLM's PP scheduling,
    see :class:`sim.stepcost.PipelineShare`); a request goes to the one with the fewest
    unfinished requests."""

    def __init__(self, engines: list):
        self.engines = engines
        self.loads = [0] * len(engines)

    def submit(self, req_id, arrival_s: float, prompt: int, output: int) -> None:
        loads = self.loads
        k = 0 if len(loads) == 1 else loads.index(min(loads))
        self.engines[k].submit(req_id, arrival_s, prompt, output)
        loads[k] += 1

    def advance_to(self, t_s: float) -> list:
        if len(self.engines) == 1:
            out = self.engines[0].advance_to(t_s)
            self.loads[0] -= len(out)
            return out
        out = []
        for k, e in enumerate(self.engines):
            done = e.advance_to(t_s)
            if done:
                self.loads[k] -= len(done)
                out += done
        return out

    @property
    def idle(self) -> bool:
        return all(e.idle for e in self.engines)

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def now_s(self) -> float:
        return max(e.now_s for e in self.engines)

    def energy_j(self) -> float:
        return sum(e.energy_j() for e in self.engines)


def engine_batch(max_batch: int, pp: int) -> int:
    """Sequences per virtual engine of a PP vPod: the DSE splits a batch of B into
    m = min(B, pp) micro-batches (``dse.costmodel``), one per virtual engine."""
    return -(-max_batch // min(max_batch, pp))


def _load(v: "SimVPod") -> float:
    """Least-loaded choice within a group: outstanding tokens over the vPod's throughput."""
    return v.outstanding / v.throughput_tok_per_s


@dataclass
class SimVPod:
    id: str
    group: str
    phase: str
    chip: str
    topology: str
    num_chips: int
    alloc: tuple
    max_batch: int
    throughput_tok_per_s: float
    created_s: float
    ready_s: float
    failover: bool = False
    state: str = "starting"
    engine: VPodEngines | None = None
    outstanding: float = 0.0
    released_s: float | None = None
    drain_from_s: float | None = None
    dcn_bytes_per_s: float = 1.0       # the vPod's DCN bandwidth (all its chips)
    delete_at_s: float | None = None   # the plan that deletes it takes effect then


@dataclass
class PhaseReport:
    requests: int = 0
    tokens: int = 0
    energy_j: float = 0.0
    cost_usd: float = 0.0
    slo_met: int = 0
    vpod_hours: dict[str, float] = field(default_factory=dict)
    failovers: int = 0
    migrations: int = 0
    dropped: int = 0      # larger than every vPod of its group's KV cache (counted as misses)

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "tokens": self.tokens, "energy_j": self.energy_j,
                "cost_usd": self.cost_usd,
                "tokens_per_j": self.tokens / self.energy_j if self.energy_j else 0.0,
                "tokens_per_usd": self.tokens / self.cost_usd if self.cost_usd else 0.0,
                "slo_rate": self.slo_met / self.requests if self.requests else 0.0,
                "vpod_hours": self.vpod_hours, "failovers": self.failovers,
                "migrations": self.migrations, "dropped": self.dropped}


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
        self._tables: dict[tuple, StepCostTable] = {}
        self.vpods: dict[str, SimVPod] = {}
        self._n_vpods = 0
        self._ready_by: dict[tuple[str, str], list[SimVPod]] = {}
        self._active: list[SimVPod] = []          # not released yet
        self._released_energy = {"prefill": 0.0, "decode": 0.0}
        self._last_energy: dict[str, float] = {}
        self._dropped = 0
        self._kv_bytes = arch.kv_bytes_per_token()
        self._draws: list[float] = []
        self.timeline: list[dict[str, Any]] = []
        self.minutes: list[dict[str, Any]] = []

    # ---- allocations --------------------------------------------------------------------------
    def table(self, alloc: tuple) -> StepCostTable:
        t = self._tables.get(alloc)
        if t is None:
            chip, topo, tp, pp, ep = alloc
            c = self.catalog.get(chip)
            cm = ChipModel(self.arch, c, ICITopology.parse(topo).for_chip(c),
                           Parallelism(tp, pp, ep))
            cache = None
            if self.cfg.cache_tables:
                from dse.xla_cost import cache_dir
                cache = cache_dir().parent / "stepcost"
            t = self._tables[alloc] = StepCostTable(cm, cache_dir=cache)
        return t

    def latency_of(self, spec, phase: str, length: int) -> float:
        """TTFT (prefill: a virtual engine's full batch of ``length``-token prompts in one step)
        or TPOT (decode: its full batch at KV ``length``) of a group's allocation on the chip
        model: the policy's latency oracle."""
        t = self.table((spec.chip, spec.topology, spec.tp, spec.pp, spec.ep))
        b, n = float(engine_batch(spec.max_batch, spec.pp)), float(length)
        if phase == "prefill":
            return t.step1(b * n, b * n * (n + 1) / 2, 0.0, 0.0)[0]
        return t.step1(0.0, 0.0, b, b * n)[0]

    def _startup_s(self, chip: str, par: Parallelism) -> float:
        c = self.catalog.get(chip)
        shard = max_weights_bytes(self.arch, par)
        return (float(self.rng.uniform(*CREATE_S)) + ENGINE_START_S
                + shard / c.dcn_bw_bytes_per_s + shard / LOAD_BW_BYTES_PER_S)

    def _entry_for(self, phase: str, chip: str, topology: str):
        for e in self.db.entries:
            if e.phase == phase and e.chip == chip and e.topology == topology and e.feasible:
                return e
        return None

    def _create(self, phase: str, a: Action, now: float, spec) -> None:
        if a.failover:
            e = self._entry_for(phase, a.chip, a.topology)
            par = Parallelism(e.tp, e.pp, e.ep)
            tput, mb = e.throughput_tok_per_s, e.max_batch
        else:
            par = Parallelism(spec.tp, spec.pp, spec.ep)
            tput, mb = spec.throughput_tok_per_s, spec.max_batch
        self._n_vpods += 1
        vid = f"{phase[0]}{self._n_vpods}"
        chips = par.chips
        ready = now + self._startup_s(a.chip, par)
        v = SimVPod(vid, a.group, phase, a.chip, a.topology, chips,
                    (a.chip, a.topology, par.tp, par.pp, par.ep), mb, max(tput, 1e-9), now,
                    ready, a.failover,
                    dcn_bytes_per_s=self.catalog.get(a.chip).dcn_bw_bytes_per_s * chips)
        self.vpods[vid] = v
        self._active.append(v)

    def _release(self, v: SimVPod, at_s: float) -> None:
        """Stop routing to ``v`` from ``at_s`` on (the slice that holds it); it drains and is
        deleted 15 s after its last request."""
        if v.state in ("draining", "released") or v.delete_at_s is not None:
            return
        v.delete_at_s = at_s

    # ---- run ----------------------------------------------------------------------------------
    def run(self, arrival_s: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray,
            progress=None) -> dict[str, PhaseReport]:
        cfg, pcfg = self.cfg, self.cfg.policy
        n = len(arrival_s)
        if n == 0:
            raise NeuScaleError("the trace has no requests")
        order = np.argsort(arrival_s, kind="stable")
        arr = np.asarray(arrival_s, np.float64)[order]
        inp = np.asarray(input_tokens, np.int64)[order]
        out = np.asarray(output_tokens, np.int64)[order]
        if (inp < 1).any() or (out < 1).any():
            raise NeuScaleError("every request needs >= 1 input and >= 1 output token")
        self.ttft = ttft = np.full(n, np.nan)
        self.tpot = tpot = np.full(n, np.nan)
        edges = np.asarray(self.db.edges)
        pre_bucket = np.searchsorted(edges, np.clip(inp, 1, edges[-1]), side="left")
        tot_bucket = np.searchsorted(edges, np.clip(inp + out, 1, edges[-1]), side="left")
        slo_p = np.asarray(self.db.meta["slo_s"]["prefill"])
        slo_d = np.asarray(self.db.meta["slo_s"]["decode"])
        # Python lists: per-request scalar access without numpy scalars
        self._arr, self._inp, self._out = arr.tolist(), inp.tolist(), out.tolist()
        self._pb, self._tb = pre_bucket.tolist(), tot_bucket.tolist()
        self._slo_p, self._slo_d = slo_p[pre_bucket].tolist(), slo_d[tot_bucket].tolist()
        self._dec_start = np.full(n, np.nan)       # first decode token available
        self._dec_end = np.full(n, np.nan)
        # each request's share of the energy of the engine steps it was in (Fig. 19c)
        self.request_energy_j = {"prefill": np.zeros(n), "decode": np.zeros(n)}
        self._segments: dict[int, list] = {}
        self._migrations = 0
        self.migration_log: list[tuple[int, str, str, int, float]] = []  # (request, from, to,
        #                                                           length, time) per migration
        nb = len(self.db.edges)
        dt = pcfg.sample_s
        window = int(round(pcfg.window_s / dt))
        ring = {ph: np.zeros((window, nb)) for ph in ("prefill", "decode")}
        filled = [0]
        self._cur_d = [0.0] * nb
        states = {ph: PolicyState() for ph in ("prefill", "decode")}
        self._routing: dict[str, RoutingTable | None] = {"prefill": None, "decode": None}
        self._planned: dict[str, RoutingTable | None] = {"prefill": None, "decode": None}
        self._held: dict[str, float] = {}     # vPods of evicted groups still routed to
        self._cands: list = []
        self._router_q: dict[tuple[str, str], list] = {}
        peak_q: dict[str, dict[str, int]] = {"prefill": {}, "decode": {}}
        self.minutes: list[dict[str, Any]] = []
        end = float(arr[-1]) + 1.0
        unrouted: list[int] = []
        epoch_every = int(round(pcfg.epoch_s / dt))
        minute_every = max(1, int(round(60.0 / dt)))

        def samples(ph: str) -> np.ndarray:
            k = filled[0]
            r = ring[ph]
            return r[:k] if k < window else np.roll(r, -(k % window), axis=0)

        if cfg.warm_start:   # the first plan sees the trace's first epoch (a running service)
            first = arr < pcfg.epoch_s
            for ph, b, tok in (("prefill", pre_bucket, inp), ("decode", tot_bucket, out)):
                s = np.bincount(b[first], weights=tok[first], minlength=nb) / pcfg.epoch_s
                ring[ph][:epoch_every] = s
            filled[0] = epoch_every
            self._epoch(0.0, {ph: samples(ph) for ph in ring}, states, peak_q,
                        warm=True)
            for v in self.vpods.values():
                v.created_s -= v.ready_s     # already running at t = 0
                v.ready_s = 0.0
        t, i, k = 0.0, 0, 0
        while t < end or any(v.engine is not None and not v.engine.idle for v in self._active) \
                or self._waiting_for_vpods():
            t_next = t + dt
            self._lifecycle(t_next)
            # arrivals of the slice -> prefill
            j = int(np.searchsorted(arr, t_next, side="left"))
            cur_p = np.bincount(pre_bucket[i:j], weights=inp[i:j], minlength=nb)
            table = self._routing["prefill"]
            if table is None:                 # cold start: nothing planned yet
                unrouted.extend(range(i, j))
            else:
                groups, arr_l, inp_l, pb = table.groups, self._arr, self._inp, self._pb
                for r in range(i, j):
                    self._submit("prefill", groups[pb[r]], r, arr_l[r], inp_l[r], 1)
            i = j
            self._flush()
            for v in self._active:
                if v.engine is not None and v.phase == "prefill":
                    self._prefill_done(v, v.engine.advance_to(t_next))
            for v in self._active:
                if v.engine is not None and v.phase == "decode":
                    self._decode_done(v, v.engine.advance_to(t_next))
            # samples and queues
            slot = filled[0] % window
            ring["prefill"][slot] = cur_p / dt
            ring["decode"][slot] = np.asarray(self._cur_d) / dt
            self._cur_d = [0.0] * nb
            filled[0] += 1
            for v in self._active:
                if v.engine is not None:
                    pq = peak_q[v.phase]
                    q = v.engine.num_waiting
                    if q > pq.get(v.group, 0):
                        pq[v.group] = q
            for (ph, g), lst in self._router_q.items():
                if len(lst) > peak_q[ph].get(g, 0):
                    peak_q[ph][g] = len(lst)
            k += 1
            t = t_next
            if k % minute_every == 0:
                self._snapshot(t)
            # a controller that starts cold plans as soon as it has seen traffic
            if (k % epoch_every == 0 and t < end) or (unrouted and
                                                      self._routing["prefill"] is None):
                self._epoch(t, {ph: samples(ph) for ph in ring}, states, peak_q)
                peak_q = {"prefill": {}, "decode": {}}
                table = self._routing["prefill"]
                for r in unrouted:
                    self._submit("prefill", table.groups[self._pb[r]], r, self._arr[r],
                                 self._inp[r], 1)
                unrouted = []
            if progress:
                progress(t)
            if t > end + 86400:
                raise NeuScaleError("simulation does not drain: requests larger than any vPod?")
        return self._report(t, arr, inp, out, ttft, tpot, pre_bucket, tot_bucket, slo_p, slo_d)

    # ---- pieces -------------------------------------------------------------------------------
    def _waiting_for_vpods(self) -> bool:
        """Requests queued at the router for a group whose vPods are still starting (after
        the trace ends, the run waits for them; requests for a group that gets no vPod at all,
        e.g. no quota and no fail-over chip, are never served and count as dropped)."""
        starting = {(v.phase, v.group) for v in self._active if v.state == "starting"}
        return any(lst and key in starting for key, lst in self._router_q.items())

    def _prefill_done(self, v: SimVPod, done: list) -> None:
        """Prefilled requests: TTFT, then (output > 1) their KV goes to a decode vPod."""
        ttft, tpot, inp_l, out_l = self.ttft, self.tpot, self._inp, self._out
        self._e_pre = self.request_energy_j["prefill"]
        for req in done:
            r = req.req_id
            x, y = inp_l[r], out_l[r]
            v.outstanding -= x
            ttft[r] = req.finish_s - self._arr[r]
            self._e_pre[r] = req.energy_j
            if y <= 1:
                tpot[r] = 0.0
                continue
            self._cur_d[self._tb[r]] += y
            segs = self._decode_segments(x, y)
            at = req.finish_s + self._kv_transfer_s(v, x)
            self._dec_start[r] = at
            g, m_end = segs[0]
            if len(segs) > 1:
                self._segments[r] = segs
            self._submit("decode", g, r, at, x, m_end)

    def _decode_done(self, v: SimVPod, done: list) -> None:
        """Finished decode segments: the request's next segment (a migration), or its TPOT."""
        e_dec = self.request_energy_j["decode"]
        for req in done:
            r = req.req_id
            v.outstanding -= req.output_tokens
            e_dec[r] += req.energy_j
            segs = self._segments.get(r)
            if segs is not None and len(segs) > 1:
                m0 = segs[0][1]                   # tokens generated when it leaves
                segs.pop(0)
                g, m1 = segs[0]
                kv = self._inp[r] + m0 - 1
                self._migrations += 1
                self.migration_log.append((r, v.group, g, kv + 1, req.finish_s))
                self._submit("decode", g, r, req.finish_s + self._kv_transfer_s(v, kv), kv,
                             m1 - m0 + 1)
                continue
            self._segments.pop(r, None)
            y = self._out[r]
            self.tpot[r] = (req.finish_s - self._dec_start[r]) / (y - 1)
            self._dec_end[r] = req.finish_s

    def _decode_segments(self, inp: int, out: int) -> list[tuple[str, int]]:
        """Where a request decodes: [(group, tokens generated when it leaves), ...].

        The output length is predicted right with probability ``accuracy`` (§5.1), else the
        request goes to a random group whose best-fit length is not shorter than its current
        length. At every bucket boundary the remaining length is re-predicted (right with the
        same probability; a wrong estimate is taken to say nothing beyond the current length)
        and the router's migration rule (:func:`router.routing.should_migrate`) may move it on
        (§3.4)."""
        table = self._routing["decode"]
        total = inp + out
        g = table.groups[min(bisect_left(table.edges, total), len(table.edges) - 1)]
        rng, acc = self.rng, self.cfg.accuracy
        u = self._draws
        if not u:           # uniforms drawn in blocks: one per routing decision
            u.extend(rng.random(4096).tolist())
        if u.pop() >= acc:
            cands = self._cands
            lo = bisect_left(cands, (inp + 1,))
            if lo < len(cands):
                if not u:
                    u.extend(rng.random(4096).tolist())
                g = cands[lo + min(int(u.pop() * (len(cands) - lo)), len(cands) - lo - 1)][1]
        segs = []
        best = table.best_len.get(g, 0)
        if total <= MIGRATE_FACTOR * best:         # no estimate or length can pass 2x
            return [(g, out)]
        edges = table.edges
        b = bisect_left(edges, inp + 1)
        while b < len(edges) and edges[b] + 1 < total:
            length = edges[b] + 1                  # enters the next bucket
            est = total if rng.random() < acc else length
            tgt = should_migrate(table, g, length, est)
            if tgt is not None and tgt != g:
                segs.append((g, length - inp))
                g = tgt
                if total <= MIGRATE_FACTOR * table.best_len.get(g, 0):
                    break
            b += 1
        segs.append((g, out))
        return segs

    def _kv_transfer_s(self, v: SimVPod, tokens: int) -> float:
        return DCN_LATENCY_S + tokens * self._kv_bytes / v.dcn_bytes_per_s

    def _ready(self, phase: str, group: str) -> list[SimVPod]:
        return self._ready_by.get((phase, group), [])

    def _index_ready(self) -> None:
        """Ready vPods per (phase, group) and the vPods not yet released; rebuilt whenever a
        vPod changes state (once per slice and after each epoch), not scanned per request."""
        idx: dict[tuple[str, str], list[SimVPod]] = {}
        active = []
        for v in self._active:
            if v.state == "ready":
                idx.setdefault((v.phase, v.group), []).append(v)
            if v.state != "released":
                active.append(v)
        self._ready_by = idx
        self._active = active

    def _submit(self, phase, group, r, at_s, inp, out) -> None:
        vs = self._ready_by.get((phase, group))
        if not vs:
            self._router_q.setdefault((phase, group), []).append((at_s, r, inp, out))
            return
        v = vs[0] if len(vs) == 1 else min(vs, key=_load)
        tokens = inp if phase == "prefill" else out
        v.outstanding += tokens
        try:
            v.engine.submit(r, at_s, inp, out)
        except ValueError:      # larger than this vPod's KV cache: dropped (an SLO miss)
            v.outstanding -= tokens
            self._dropped += 1

    def _flush(self) -> None:
        rq = self._router_q
        for (ph, g), lst in list(rq.items()):
            if lst and self._ready_by.get((ph, g)):
                rq[(ph, g)] = []
                for at_s, r, inp, out in lst:
                    self._submit(ph, g, r, at_s, inp, out)

    def _lifecycle(self, t_next: float) -> None:
        for v in self._active:
            if v.delete_at_s is not None and v.delete_at_s < t_next and \
                    v.state in ("starting", "ready"):
                v.state = "draining"
                v.drain_from_s = v.delete_at_s
            if v.state == "starting" and v.ready_s < t_next:
                v.state = "ready"
                table = self.table(v.alloc)
                pp = v.alloc[3]
                cost = table if pp == 1 else PipelineShare(table, pp)
                cls = PrefillEngine if v.phase == "prefill" else DecodeEngine
                v.engine = VPodEngines([
                    cls(cost, max_batch=engine_batch(v.max_batch, pp),
                        max_batched_tokens=max(self.cfg.max_batched_tokens, v.max_batch),
                        start_s=v.ready_s) for _ in range(pp)])
            if v.state == "draining" and (v.engine is None or v.engine.idle):
                v.state = "released"
                v.released_s = max(v.drain_from_s or 0.0,
                                   v.engine.now_s if v.engine else 0.0) + DELETE_S
                self._released_energy[v.phase] += self._vpod_energy(v, v.released_s)
        self._index_ready()
        self._route_tables(t_next)

    def _vpod_energy(self, v: SimVPod, stop_s: float) -> float:
        """Energy of a vPod from creation to ``stop_s``: static power while it starts up, its
        engines (steps, and static power while idle) after."""
        c = self.catalog.get(v.chip)
        e = c.static_power_w * v.num_chips * max(0.0, min(v.ready_s, stop_s) - v.created_s)
        if v.engine is not None:
            v.engine.advance_to(stop_s)
            e += v.engine.energy_j()
        return e

    def _snapshot(self, t: float) -> None:
        """One row per minute and phase: vPods per group (ready) and the energy used in the
        minute (engines' energy up to their clocks); requests finished in the minute and the
        share that met the SLO are added from the finish times by :meth:`_report`."""
        for ph in ("prefill", "decode"):
            groups: dict[str, int] = {}
            energy = self._released_energy[ph]
            for v in self._active:
                if v.phase != ph:
                    continue
                if v.state == "ready":
                    groups[v.group] = groups.get(v.group, 0) + 1
                c = self.catalog.get(v.chip)
                energy += c.static_power_w * v.num_chips * max(0.0, min(v.ready_s, t)
                                                               - v.created_s)
                if v.engine is not None:
                    energy += v.engine.energy_j()
            prev = self._last_energy.get(ph, 0.0)
            self._last_energy[ph] = energy
            self.minutes.append({"t_s": t, "phase": ph, "vpods": groups,
                                 "energy_j": energy - prev})

    def _epoch(self, now, samples, states, peak_q, warm: bool = False) -> None:
        # the statistics are read at ``now``; the controller gets them 2-5 s later (Table 3)
        # and its actions start then (the plan itself takes milliseconds)
        act = now if warm else now + float(self.rng.uniform(*STATS_QUERY_S))
        for ph, pol in self.policies.items():
            inv = [VPod(v.id, v.group, v.chip, v.topology, v.num_chips, v.state, v.failover,
                        v.throughput_tok_per_s, v.max_batch)
                   for v in self._active if v.phase == ph and v.state in ("starting", "ready")
                   and v.delete_at_s is None]
            used: dict[str, int] = {}
            for v in self._active:
                used[v.chip] = used.get(v.chip, 0) + v.num_chips
            avail = {c: q - used.get(c, 0) for c, q in self.cfg.quotas.items()}
            rates = {b: samples[ph][:, b] for b in range(samples[ph].shape[1])
                     if samples[ph][:, b].any()}
            plan = pol.plan(Observation(now, rates, inv, peak_q[ph], avail), states[ph])
            states[ph] = plan.state
            self._planned[ph] = plan.routing
            planned_groups = set(plan.routing.groups)
            for a in plan.actions:
                if a.kind == "create":
                    self._create(ph, a, act, plan.groups[a.group])
                elif a.kind == "delete" and a.vpod_id in self.vpods:
                    v = self.vpods[a.vpod_id]
                    if v.group not in planned_groups:     # an evicted group: make before break
                        self._held.setdefault(v.id, act)
                    else:
                        self._release(v, act)
                elif a.kind == "replace" and a.vpod_id in self.vpods:
                    spec = plan.groups[a.group]
                    self._create(ph, Action("create", a.group, a.reason, spec.chip,
                                            spec.topology, 1), act, spec)
                    self._release(self.vpods[a.vpod_id], act)
            self.timeline.append({"t_s": now, "phase": ph, "target": dict(plan.target),
                                  "actions": len(plan.actions)})
        self._index_ready()
        self._route_tables(now)

    def _route_tables(self, now: float) -> None:
        """The tables the router uses: each phase's planned table, with buckets whose new
        group has no ready vPod yet left on their old group (router.routing.make_before_break);
        vPods of evicted groups are released once no bucket routes to them."""
        for ph, planned in self._planned.items():
            if planned is None:
                continue
            old = self._routing[ph]
            eff = planned if not self.cfg.make_before_break else make_before_break(
                planned, old, lambda g, ph=ph: bool(self._ready_by.get((ph, g))))
            if eff is not old:
                self._routing[ph] = eff
                if ph == "decode":     # mis-predicted requests pick among these (by length)
                    self._cands = sorted((eff.best_len.get(g, 0), g) for g in set(eff.groups))
        if self._held:
            used = {(ph, g) for ph, t in self._routing.items() if t is not None
                    for g in set(t.groups)}
            for vid in list(self._held):
                v = self.vpods[vid]
                if (v.phase, v.group) not in used or v.state not in ("starting", "ready"):
                    self._release(v, max(self._held.pop(vid), now))

    def _report(self, t_end, arr, inp, out, ttft, tpot, pb, tb, slo_p, slo_d):
        rep = {"prefill": PhaseReport(), "decode": PhaseReport()}
        for v in self.vpods.values():
            r = rep[v.phase]
            c = self.catalog.get(v.chip)
            stop = v.released_s if v.released_s is not None else t_end
            r.energy_j += self._vpod_energy(v, stop)
            held_s = max(0.0, stop - v.created_s)
            r.cost_usd += v.num_chips * c.price_usd_per_chip_hour * held_s / 3600
            r.vpod_hours[v.chip] = r.vpod_hours.get(v.chip, 0.0) + held_s / 3600
            r.failovers += int(v.failover)
        p, d = rep["prefill"], rep["decode"]
        p.requests = len(arr)
        served = np.isfinite(ttft)          # dropped requests produce no tokens
        p.tokens = int(inp[served].sum())
        p.slo_met = int(np.sum(ttft <= slo_p[pb]))
        multi = out > 1
        d.requests = int(multi.sum())
        d.tokens = int((out[multi & np.isfinite(tpot)] - 1).sum())
        d.slo_met = int(np.sum((tpot <= slo_d[tb]) & multi))
        d.migrations = self._migrations
        met = {"prefill": (arr + ttft, ttft <= slo_p[pb]),
               "decode": (self._dec_end, (tpot <= slo_d[tb]) & multi)}
        bins = {}
        for ph, (fin_s, ok) in met.items():       # minute k holds finish times in (60k, 60k+60]
            good = np.isfinite(fin_s)
            k = np.maximum(np.ceil(fin_s[good] / 60.0).astype(np.int64) - 1, 0)
            size = int(k.max()) + 1 if len(k) else 0
            bins[ph] = (np.bincount(k, minlength=size), np.bincount(k, weights=ok[good],
                                                                    minlength=size))
        for m in self.minutes:
            cnt, ok = bins[m["phase"]]
            k = int(round(m["t_s"] / 60.0)) - 1
            m["finished"] = int(cnt[k]) if k < len(cnt) else 0
            m["slo_rate"] = float(ok[k] / cnt[k]) if m["finished"] else None
        p.dropped = int(np.isnan(ttft).sum())
        d.dropped = int((np.isnan(tpot) & multi).sum())
        self.requests = (arr, inp, out)       # the order of self.ttft / self.tpot
        return rep


def verified_db(arch: ModelArch, metric: str = "energy", slo_scale: float = 5.0,
                chips: tuple[str, ...] | None = None, catalog: Catalog | None = None,
                progress=None) -> BestFitDB:
    """The simulator's default best-fit DB: built, checked on the chip model (``dse verify``:
    the engines run on it) and cached next to the XLA-fit cache after the first call."""
    import sys

    from dse.builder import BuildOptions, build
    from dse.costmodel import MODEL_VERSION
    from dse.xla_cost import cache_dir

    from .validate import verify_db
    catalog = catalog or default_catalog()
    key = (f"{arch.name}-{arch.fingerprint()}-m{MODEL_VERSION}-{metric}-{slo_scale:g}-"
           f"{'_'.join(chips) if chips else 'all'}-verified.json")
    path = cache_dir().parent / "db" / key
    if path.exists():
        return BestFitDB.load(path)
    print(f"building and verifying the best-fit database for {arch.name} (cached at {path})",
          file=sys.stderr)
    db = build(arch, BuildOptions(metric=metric, slo_scale=slo_scale, chips=chips,
                                  progress=progress), catalog=catalog)
    db = verify_db(db, arch, catalog)
    path.parent.mkdir(parents=True, exist_ok=True)
    db.save(path)
    return db


def ideal_report(arch: ModelArch, db: BestFitDB, arrival_s, input_tokens, output_tokens,
                 catalog: Catalog | None = None, per_request: dict | None = None
                 ) -> dict[str, PhaseReport]:
    """The oracle of §5.1: every request on its best-fit vPod in a full batch of its own length,
    priced on the chip model (energy and dollars per token at the best fit's max batch).
    ``per_request`` (a dict) receives each request's energy and the best fit's latency."""
    catalog = catalog or default_catalog()
    inp = np.asarray(input_tokens, np.int64)
    out = np.asarray(output_tokens, np.int64)
    cache: dict[tuple[str, int], tuple[float, float]] = {}

    def per_token(phase: str, length: int) -> tuple[float, float]:
        i = db.bucket_index(min(int(length), db.edges[-1]))
        key = (phase, i)
        if key not in cache:
            e = db.entry_at(phase, i)
            if e is None or not e.feasible:
                raise NeuScaleError(f"no {phase} best fit at {length} tokens")
            c = catalog.get(e.chip)
            cm = ChipModel(arch, c, ICITopology.parse(e.topology).for_chip(c),
                           Parallelism(e.tp, e.pp, e.ep))
            r = cm.step(phase, e.max_batch, db.edges[i])
            cache[key] = (r.energy_j / r.tokens,
                          r.cycle_s * e.num_chips * c.price_usd_per_chip_hour / 3600 / r.tokens,
                          e.latency_s)
        return cache[key]

    rep = {"prefill": PhaseReport(), "decode": PhaseReport()}
    p, d = rep["prefill"], rep["decode"]
    n = len(inp)
    e_p, e_d, l_p, l_d = (np.zeros(n) for _ in range(4))
    for k, (x, y) in enumerate(zip(inp.tolist(), out.tolist())):
        ej, usd, lat = per_token("prefill", x)
        p.energy_j += ej * x
        p.cost_usd += usd * x
        e_p[k], l_p[k] = ej * x, lat
        if y > 1:
            ej, usd, lat = per_token("decode", x + y)
            d.energy_j += ej * (y - 1)
            d.cost_usd += usd * (y - 1)
            e_d[k], l_d[k] = ej * (y - 1), lat
    if per_request is not None:
        per_request.update({"input": inp, "output": out, "ttft_s": l_p, "tpot_s": l_d,
                            "prefill_energy_j": e_p, "decode_energy_j": e_d})
    p.requests, p.tokens, p.slo_met = len(inp), int(inp.sum()), len(inp)
    multi = out > 1
    d.requests, d.tokens = int(multi.sum()), int((out[multi] - 1).sum())
    d.slo_met = d.requests
    return rep


def make_policies(name: str, db: BestFitDB, config: PolicyConfig, input_tokens, output_tokens,
                  phase_chips: Mapping[str, tuple[str, ...] | None] | None = None
                  ) -> dict[str, Policy]:
    """``neuscale`` (the §3.4 policy), ``base`` (one group sized for the longest request) or
    ``multipool:K`` (K fixed percentile pools, §5.5); ``phase_chips`` restricts each phase's
    autoscaler to some chip versions (§5.4's chip mixes)."""
    from dataclasses import replace

    from orchestrator.policy import BasePolicy, MultiPoolPolicy
    if phase_chips:
        cfgs = {ph: replace(config, chips=phase_chips.get(ph) or config.chips)
                for ph in ("prefill", "decode")}
        pols = {}
        for ph in ("prefill", "decode"):
            pols[ph] = make_policies(name, db, cfgs[ph], input_tokens, output_tokens)[ph]
        return pols
    if name.startswith("multipool:"):
        try:
            k = int(name.split(":", 1)[1])
        except ValueError:
            raise NeuScaleError(f"policy {name!r}: expected multipool:K with an integer K") \
                from None
        inp = np.asarray(input_tokens)
        tot = inp + np.asarray(output_tokens)
        return {"prefill": MultiPoolPolicy(db, "prefill", inp, k, config),
                "decode": MultiPoolPolicy(db, "decode", tot, k, config)}
    if name == "neuscale":
        return {ph: Policy(db, ph, config) for ph in ("prefill", "decode")}
    if name == "base":
        inp = np.asarray(input_tokens)
        tot = inp + np.asarray(output_tokens)
        return {"prefill": BasePolicy(db, "prefill", int(inp.max()), config),
                "decode": BasePolicy(db, "decode", int(tot.max()), config)}
    raise NeuScaleError(f"unknown policy {name!r}; known: neuscale, base, ideal, multipool:K")
