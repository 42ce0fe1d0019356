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
from router.routing import RoutingTable

from .chip import ChipModel
from .engine import Engine
from .stepcost import PipelineShare, StepCostTable

CREATE_S = (73.0, 108.0)        # Table 3: create a vPod instance
DELETE_S = 15.0                 # Table 3: delete a vPod instance
ENGINE_START_S = 31.0           # Table 3: NPU runtime and serving engine start-up
LOAD_BW_BYTES_PER_S = 24e9      # Table 3: load weights to the chips, per chip (PCIe 4.0 x16)
DCN_LATENCY_S = 1e-3            # per KV transfer between vPods (order of Fig. 13's small sizes)


@dataclass(frozen=True)
class ClusterConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    accuracy: float = 0.6
    quotas: Mapping[str, int] = field(default_factory=dict)     # chips per version (absent: no limit)
    seed: int = 0
    max_batched_tokens: int = 8192
    warm_start: bool = True      # first plan at t=0 from the trace's first epoch


class VPodEngines:
    """The engines of one vPod: one, or ``pp`` pipeline virtual engines (vLLM's PP scheduling,
    see :class:`sim.stepcost.PipelineShare`); a request goes to the least busy one."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines

    def submit(self, req_id, arrival_s: float, prompt: int, output: int) -> None:
        e = min(self.engines, key=lambda x: x.num_waiting + x.num_running)
        e.submit(req_id, arrival_s, prompt, output)

    def advance_to(self, t_s: float) -> list:
        out = []
        for e in self.engines:
            out += e.advance_to(t_s)
        return out

    @property
    def idle(self) -> bool:
        return all(e.idle for e in self.engines)

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def now_s(self) -> float | None:
        return max((e.now_s or 0.0) for e in self.engines)

    def energy_j(self) -> float:
        return sum(e.stats().energy_j for e in self.engines)


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

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "tokens": self.tokens, "energy_j": self.energy_j,
                "cost_usd": self.cost_usd,
                "tokens_per_j": self.tokens / self.energy_j if self.energy_j else 0.0,
                "tokens_per_usd": self.tokens / self.cost_usd if self.cost_usd else 0.0,
                "slo_rate": self.slo_met / self.requests if self.requests else 0.0,
                "vpod_hours": self.vpod_hours, "failovers": self.failovers,
                "migrations": self.migrations}


class ClusterSim:
    def __init__(self, arch: ModelArch, db: BestFitDB, policies: Mapping[str, Policy],
                 config: ClusterConfig = ClusterConfig(), catalog: Catalog | None = None):
        self.arch, self.db, self.cfg = arch, db, config
        self.catalog = catalog or default_catalog()
        self.policies = dict(policies)
        self.rng = np.random.default_rng(config.seed)
        self._tables: dict[tuple, StepCostTable] = {}
        self.vpods: dict[str, SimVPod] = {}
        self._n_vpods = 0
        self._ready_by: dict[tuple[str, str], list[SimVPod]] = {}
        self.timeline: list[dict[str, Any]] = []

    # ---- allocations --------------------------------------------------------------------------
    def table(self, alloc: tuple) -> StepCostTable:
        t = self._tables.get(alloc)
        if t is None:
            chip, topo, tp, pp, ep = alloc
            c = self.catalog.get(chip)
            cm = ChipModel(self.arch, c, ICITopology.parse(topo).for_chip(c),
                           Parallelism(tp, pp, ep))
            t = self._tables[alloc] = StepCostTable(cm)
        return t

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
        self.vpods[vid] = SimVPod(vid, a.group, phase, a.chip, a.topology, chips,
                                  (a.chip, a.topology, par.tp, par.pp, par.ep), mb, tput, now,
                                  ready, a.failover)

    def _release(self, v: SimVPod, now: float) -> None:
        if v.state in ("draining", "released"):
            return
        v.state = "draining"
        v.drain_from_s = now

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
        ttft = np.full(n, np.nan)
        tpot = np.full(n, np.nan)
        dec_bucket = np.zeros(n, np.int64)
        edges = np.asarray(self.db.edges)
        pre_bucket = np.searchsorted(edges, np.clip(inp, 1, edges[-1]), side="left")
        tot_bucket = np.searchsorted(edges, np.clip(inp + out, 1, edges[-1]), side="left")
        slo_p = np.asarray(self.db.meta["slo_s"]["prefill"])
        slo_d = np.asarray(self.db.meta["slo_s"]["decode"])
        nb = len(self.db.edges)
        dt = pcfg.sample_s
        window = int(round(pcfg.window_s / dt))
        samples = {ph: np.zeros((0, nb)) for ph in ("prefill", "decode")}
        cur = {ph: np.zeros(nb) for ph in ("prefill", "decode")}
        states = {ph: PolicyState() for ph in ("prefill", "decode")}
        routing: dict[str, RoutingTable | None] = {"prefill": None, "decode": None}
        specs: dict[str, dict] = {"prefill": {}, "decode": {}}
        router_q: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
        peak_q: dict[str, dict[str, int]] = {"prefill": {}, "decode": {}}
        end = float(arr[-1]) + 1.0
        unrouted: list[int] = []
        t = 0.0
        i = 0
        epoch_every = int(round(pcfg.epoch_s / dt))
        k = 0
        if cfg.warm_start:   # the first plan sees the trace's first epoch (a running service)
            first = arr < pcfg.epoch_s
            for ph, b, tok in (("prefill", pre_bucket, inp), ("decode", tot_bucket, out)):
                s = np.bincount(b[first], weights=tok[first], minlength=nb) / pcfg.epoch_s
                samples[ph] = np.tile(s, (epoch_every, 1))
            self._epoch(0.0, samples, states, routing, specs, peak_q, warm=True)
            for v in self.vpods.values():
                v.created_s -= v.ready_s     # already running at t = 0
                v.ready_s = 0.0
        while t < end or any(v.engine is not None and not v.engine.idle
                             for v in self.vpods.values()):
            t_next = t + dt
            self._lifecycle(t_next)
            # arrivals of the slice -> prefill
            j = int(np.searchsorted(arr, t_next, side="left"))
            for r in range(i, j):
                cur["prefill"][pre_bucket[r]] += inp[r]
                if routing["prefill"] is None:      # cold start: nothing planned yet
                    unrouted.append(r)
                    continue
                g = routing["prefill"].prefill_group(int(inp[r]))
                self._submit("prefill", g, r, float(arr[r]), int(inp[r]), 1, router_q, specs)
            i = j
            self._flush(router_q, t_next, specs)
            # prefill -> decode
            for v in [v for v in self.vpods.values() if v.phase == "prefill" and v.engine]:
                for req in v.engine.advance_to(t_next):
                    r = req.req_id
                    v.outstanding -= inp[r]
                    ttft[r] = req.first_token_s - arr[r]
                    if out[r] <= 1:
                        tpot[r] = 0.0
                        continue
                    g = self._decode_group(routing["decode"], int(inp[r]), int(out[r]))
                    dec_bucket[r] = tot_bucket[r]
                    cur["decode"][tot_bucket[r]] += out[r]
                    ready_at = req.finish_s + self._kv_transfer_s(v, int(inp[r]))
                    self._submit("decode", g, r, ready_at, int(inp[r]), int(out[r]), router_q,
                                 specs)
            for v in [v for v in self.vpods.values() if v.phase == "decode" and v.engine]:
                for req in v.engine.advance_to(t_next):
                    r = req.req_id
                    v.outstanding -= out[r]
                    tpot[r] = req.tpot_s if req.tpot_s is not None else 0.0
            # samples and queues
            for ph in ("prefill", "decode"):
                samples[ph] = np.vstack([samples[ph], cur[ph] / dt])[-window:]
                cur[ph] = np.zeros(nb)
                for v in self.vpods.values():
                    if v.phase == ph and v.engine is not None:
                        q = v.engine.num_waiting
                        peak_q[ph][v.group] = max(peak_q[ph].get(v.group, 0), q)
                for (ph2, g), lst in router_q.items():
                    if ph2 == ph:
                        peak_q[ph][g] = max(peak_q[ph].get(g, 0), len(lst))
            k += 1
            t = t_next
            # a controller that starts cold plans as soon as it has seen traffic
            if (k % epoch_every == 0 and t < end) or (unrouted and routing["prefill"] is None):
                self._epoch(t, samples, states, routing, specs, peak_q)
                peak_q = {"prefill": {}, "decode": {}}
                for r in unrouted:
                    g = routing["prefill"].prefill_group(int(inp[r]))
                    self._submit("prefill", g, r, float(arr[r]), int(inp[r]), 1, router_q,
                                 specs)
                unrouted = []
            if progress:
                progress(t)
            if t > end + 86400:
                raise NeuScaleError("simulation does not drain: requests larger than any vPod?")
        return self._report(t, arr, inp, out, ttft, tpot, pre_bucket, tot_bucket, slo_p, slo_d)

    # ---- pieces -------------------------------------------------------------------------------
    def _decode_group(self, table: RoutingTable, inp: int, out: int):
        true_g = table.decode_group(inp, out)
        if self.rng.random() < self.cfg.accuracy:
            return true_g
        cur_len = inp + 1
        cands = sorted({g for g in table.groups if table.best_len.get(g, 0) >= cur_len})
        return cands[int(self.rng.integers(len(cands)))] if cands else true_g

    def _kv_transfer_s(self, v: SimVPod, tokens: int) -> float:
        bw = self.catalog.get(v.chip).dcn_bw_bytes_per_s * v.num_chips
        return DCN_LATENCY_S + tokens * self.arch.kv_bytes_per_token() / bw

    def _ready(self, phase: str, group: str) -> list[SimVPod]:
        return self._ready_by.get((phase, group), [])

    def _index_ready(self) -> None:
        """Ready vPods per (phase, group); rebuilt whenever a vPod changes state (once per
        slice and after each epoch), not scanned per routed request."""
        idx: dict[tuple[str, str], list[SimVPod]] = {}
        for v in self.vpods.values():
            if v.state == "ready":
                idx.setdefault((v.phase, v.group), []).append(v)
        self._ready_by = idx

    def _submit(self, phase, group, r, at_s, inp, out, router_q, specs) -> None:
        vs = self._ready(phase, group)
        if not vs:
            router_q.setdefault((phase, group), []).append((at_s, r, inp, out))
            return
        v = min(vs, key=lambda x: x.outstanding / max(x.throughput_tok_per_s, 1e-9))
        tokens = inp if phase == "prefill" else out
        v.outstanding += tokens
        try:
            v.engine.submit(r, at_s, inp, out)
        except ValueError:      # larger than this vPod's KV cache: dropped (an SLO miss)
            v.outstanding -= tokens

    def _flush(self, router_q, now, specs) -> None:
        for (ph, g), lst in list(router_q.items()):
            if lst and self._ready(ph, g):
                router_q[(ph, g)] = []
                for at_s, r, inp, out in lst:
                    self._submit(ph, g, r, at_s, inp, out, router_q, specs)

    def _lifecycle(self, t_next: float) -> None:
        for v in self.vpods.values():
            if v.state == "starting" and v.ready_s < t_next:
                v.state = "ready"
                table = self.table(v.alloc)
                pp = v.alloc[3]
                cost = table if pp == 1 else PipelineShare(table, pp)
                v.engine = VPodEngines([
                    Engine(cost, mode=v.phase, max_batch=v.max_batch,
                           max_batched_tokens=max(self.cfg.max_batched_tokens, v.max_batch),
                           start_s=v.ready_s) for _ in range(pp)])
            if v.state == "draining" and (v.engine is None or v.engine.idle):
                v.state = "released"
                v.released_s = max(v.drain_from_s or 0.0,
                                   v.engine.now_s or 0.0 if v.engine else 0.0) + DELETE_S
        self._index_ready()

    def _epoch(self, now, samples, states, routing, specs, peak_q, warm=False) -> None:
        for ph, pol in self.policies.items():
            inv = [VPod(v.id, v.group, v.chip, v.topology, v.num_chips,
                        "ready" if v.state == "ready" else v.state, v.failover,
                        v.throughput_tok_per_s, v.max_batch)
                   for v in self.vpods.values() if v.phase == ph and
                   v.state in ("starting", "ready")]
            used: dict[str, int] = {}
            for v in self.vpods.values():
                if v.state != "released":
                    used[v.chip] = used.get(v.chip, 0) + v.num_chips
            avail = {c: q - used.get(c, 0) for c, q in self.cfg.quotas.items()}
            rates = {b: samples[ph][:, b] for b in range(samples[ph].shape[1])
                     if samples[ph][:, b].any()}
            plan = pol.plan(Observation(now, rates, inv, peak_q[ph], avail), states[ph])
            states[ph] = plan.state
            specs[ph].update(plan.groups)
            routing[ph] = plan.routing
            for a in plan.actions:
                if a.kind == "create":
                    self._create(ph, a, now, plan.groups[a.group])
                elif a.kind == "delete" and a.vpod_id in self.vpods:
                    self._release(self.vpods[a.vpod_id], now)
                elif a.kind == "replace" and a.vpod_id in self.vpods:
                    spec = plan.groups[a.group]
                    self._create(ph, Action("create", a.group, a.reason, spec.chip,
                                            spec.topology, 1), now, spec)
                    self._release(self.vpods[a.vpod_id], now)
            self.timeline.append({"t_s": now, "phase": ph, "target": dict(plan.target),
                                  "actions": len(plan.actions)})
        self._index_ready()

    def _report(self, t_end, arr, inp, out, ttft, tpot, pb, tb, slo_p, slo_d):
        rep = {"prefill": PhaseReport(), "decode": PhaseReport()}
        for v in self.vpods.values():
            r = rep[v.phase]
            c = self.catalog.get(v.chip)
            stop = v.released_s if v.released_s is not None else t_end
            if v.engine is not None:
                v.engine.advance_to(stop)
                r.energy_j += v.engine.energy_j()
            r.energy_j += c.static_power_w * v.num_chips * max(0.0, min(v.ready_s, stop)
                                                               - v.created_s)
            held_s = max(0.0, stop - v.created_s)
            r.cost_usd += v.num_chips * c.price_usd_per_chip_hour * held_s / 3600
            r.vpod_hours[v.chip] = r.vpod_hours.get(v.chip, 0.0) + held_s / 3600
            r.failovers += int(v.failover)
        p, d = rep["prefill"], rep["decode"]
        p.requests = len(arr)
        p.tokens = int(inp.sum())
        p.slo_met = int(np.sum(ttft <= slo_p[pb]))
        multi = out > 1
        d.requests = int(multi.sum())
        d.tokens = int((out[multi] - 1).sum())
        d.slo_met = int(np.sum((tpot <= slo_d[tb]) & multi))
        self.ttft, self.tpot = ttft, tpot
        return rep


def ideal_report(arch: ModelArch, db: BestFitDB, arrival_s, input_tokens, output_tokens,
                 catalog: Catalog | None = None) -> dict[str, PhaseReport]:
    """The oracle of §5.1: every request on its best-fit vPod in a full batch of its own length,
    priced on the chip model (energy and dollars per token at the best fit's max batch)."""
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
                          r.cycle_s * e.num_chips * c.price_usd_per_chip_hour / 3600 / r.tokens)
        return cache[key]

    rep = {"prefill": PhaseReport(), "decode": PhaseReport()}
    p, d = rep["prefill"], rep["decode"]
    for x, y in zip(inp, out):
        ej, usd = per_token("prefill", int(x))
        p.energy_j += ej * x
        p.cost_usd += usd * x
        if y > 1:
            ej, usd = per_token("decode", int(x + y))
            d.energy_j += ej * (y - 1)
            d.cost_usd += usd * (y - 1)
    p.requests, p.tokens, p.slo_met = len(inp), int(inp.sum()), len(inp)
    multi = out > 1
    d.requests, d.tokens = int(multi.sum()), int((out[multi] - 1).sum())
    d.slo_met = d.requests
    return rep


def make_policies(name: str, db: BestFitDB, config: PolicyConfig, input_tokens, output_tokens
                  ) -> dict[str, Policy]:
    """``neuscale`` (the §3.4 policy), ``base`` (one group sized for the longest request) or
    ``multipool:K`` (K fixed percentile pools, §5.5)."""
    from orchestrator.policy import BasePolicy, MultiPoolPolicy
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
