"""The controller: the policy's wall-clock driver (paper §3.4, Fig. 12).

Every ``sample_s`` it reads the gateway's counters (tokens per bucket that arrived for prefill
and were handed to decode, requests waiting at the gateway) and the engines' ``/metrics``
(``vllm:num_requests_waiting``) into the same :class:`~orchestrator.window.ObservationWindow`
the cluster simulator fills; every ``epoch_s`` - and at once at a cold start (traffic with no
group yet) - it runs the same :class:`~orchestrator.policy.Policy` per phase; between epochs a
group whose aggregated queue is an emergency gets that group's scale-out at once
(:meth:`~orchestrator.policy.Policy.plan_emergency`, once per start-up:
:class:`~orchestrator.policy.EmergencyGate`, as the simulator). It actuates each plan through a
backend:
creations and deletions with bounded concurrency and retries, fail-over on quota errors,
make-before-break routing (:func:`router.routing.make_before_break`; a group's scale-in waits
while it still serves buckets handed to a group not up yet), draining before deleting,
health checks that replace dead vPods. Its state lives in SQLite (:mod:`orchestrator.state`),
so a controller killed at any instant reconciles with the backend on restart.

Time: the data plane runs in real time (token rates are real tokens/s, comparable with the
DB's throughputs); the control plane's clock (the policy's 10-s samples, 5-min epochs, 30-min
window, 30-min shrink period) runs ``time_scale`` times faster, as do the backend's Table 3
delays (the simulated backend divides them by the same factor), so a person sees scaling
happen in seconds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import aiohttp

from backends.base import (Backend, BackendError, ConfigError, QuotaError,
                           VPodInfo, VPodSpec, label_value, with_retries)
from dse.db import BestFitDB, Entry
from dse.parallel import LAYOUT_SUFFIX
from dse.vpod import VPodState
from router.gateway import Endpoint, Gateway
from router.routing import RoutingTable, handing_over, make_before_break

from .policy import (ActionKind, EmergencyGate, Plan, Policy, PolicyConfig, PolicyState,
                     VPodRecord)
from .registry import PHASES
from .state import StateStore, VPodRow
from .window import ObservationWindow, available_chips, chips_in_use

# a deleted vPod's reason while its group still hands buckets over (router.routing.handing_over)
HELD = "held until its group's hand-off is done"

log = logging.getLogger("neuscale.controller")


@dataclass(frozen=True)
class ControllerConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    time_scale: float = 60.0            # control-plane seconds per wall second
    cluster: str = "neuscale"           # the label that marks this cluster's vPods
    model: str = "llama3-8b"            # what the engines serve
    quotas: Mapping[str, int] = field(default_factory=dict)   # known chips per version
    max_concurrent_actions: int = 8     # backend calls in flight
    health_failures: int = 3            # consecutive failed /health -> the vPod is dead
    orphan_grace_s: float = 600.0       # control-plane s before an unknown vPod is deleted
    quota_memory_s: float = 1800.0      # control-plane s a learned quota limit is kept
    drain_timeout_s: float = 1800.0     # control-plane s a drain may take before deletion
    # Before the first request: one vPod per phase for a typical request (these input and
    # total lengths), so the first client does not wait for a cold start; with no traffic the
    # window forgets it and the groups are evicted like any other.
    bootstrap: bool = True
    bootstrap_lengths: tuple[int, int] = (1024, 1280)
    # the engines' --max-model-len (vLLM's per-request limit of prompt + output): the model's
    # context; a request is routed by length, not refused by a short group (it migrates)
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")


class Controller:
    def __init__(self, db: BestFitDB, backend: Backend, gateway: Gateway, state: StateStore,
                 config: ControllerConfig = ControllerConfig(),
                 policies: Mapping[str, Policy] | None = None, recalibrator=None):
        """``recalibrator``: an :class:`orchestrator.calibration.Recalibrator` that the
        engines' metrics feed every sample and that updates its correction factors (which the
        policies' calibrated pricer reads) every epoch; None: no recalibration."""
        self.db, self.backend, self.gateway, self.state = db, backend, gateway, state
        self.recal = recalibrator
        self.cfg = config
        self.policies = dict(policies or {ph: Policy(db, ph, config.policy) for ph in PHASES})
        self.window = ObservationWindow(len(db.edges), config.policy)
        self.pstate = {ph: PolicyState() for ph in PHASES}
        self._gate = EmergencyGate()     # emergencies planned between epochs, once per start-up
        self.planned: dict[str, RoutingTable | None] = {ph: None for ph in PHASES}
        self.routing: dict[str, RoutingTable | None] = {ph: None for ph in PHASES}
        self.vpods: dict[str, VPodRow] = {}
        self.learned_quota: dict[str, tuple[int, float]] = {}    # chip -> (limit, since)
        self.events: list[dict[str, Any]] = []                   # recent actions, for status
        self._health_fail: dict[str, int] = {}
        self._sem = asyncio.Semaphore(config.max_concurrent_actions)
        self._tasks: set[asyncio.Task] = set()
        t0 = state.get_meta("clock_origin")
        if t0 is None:
            t0 = repr(time.time())
            state.set_meta("clock_origin", t0)
        self._t0 = float(t0)
        self._last_sample = time.monotonic()
        self._last_epoch_cp = -math.inf
        self._wake = asyncio.Event()
        self._stopping = False
        self._session: aiohttp.ClientSession | None = None
        self._n = 0
        self._log_buf: list[dict[str, Any]] = []
        self._checking: set[str] = set()

    # ---- clocks -------------------------------------------------------------------------------
    def now_cp(self) -> float:
        """Control-plane time: wall seconds since the state was created x time_scale (kept
        across restarts, so the policy's remembered times stay meaningful)."""
        return (time.time() - self._t0) * self.cfg.time_scale

    def wall(self, cp_seconds: float) -> float:
        return cp_seconds / self.cfg.time_scale

    # ---- start, run, stop ---------------------------------------------------------------------
    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self._restore()
        await self.reconcile()
        if self.cfg.bootstrap and not self.vpods and self.planned["decode"] is None:
            self._bootstrap()
        self._publish()

    def _bootstrap(self) -> None:
        """One 10-s sample of 1 token/s in the buckets of a typical request, and a plan: one
        vPod per phase starts now."""
        record_bootstrap(self.window, self.db.edges, self.cfg.bootstrap_lengths)
        self.epoch()

    def log_request(self, record: dict[str, Any]) -> None:
        """The gateway's record of a finished request, for the served-request log (written in
        batches each sample)."""
        self._log_buf.append(record)

    def _restore(self) -> None:
        for v in self.state.live_vpods():
            self.vpods[v.id] = v
        self._n = len(self.state.vpods())
        for ph in PHASES:
            s = self.state.get_json(f"policy_state:{ph}")
            if s:
                self.pstate[ph] = _policy_state_from_json(s)
            t = self.state.get_json(f"routing:{ph}")
            if t:
                self.planned[ph] = _table_from_json(t)
        g = self.state.get_json("emergency_gate")
        if g:
            self._gate = EmergencyGate.from_json(g)
        if any(t is not None for t in self.planned.values()):
            # The window is not in the state file: a restarted controller has seen no traffic.
            # Planning at its first sample would plan over an empty window - no groups, no
            # routing table (503s until traffic made it plan again) and every adopted vPod
            # scaled in. It keeps the routing and vPods it restored for an epoch of samples
            # of its own (emergencies between epochs still act).
            self._last_epoch_cp = self.now_cp()

    async def reconcile(self) -> None:
        """Make the state and the backend agree: adopt this cluster's vPods the state knows,
        delete unknown ones (orphans of a crash between recording and creating are younger
        than the grace period: they are adopted if recorded, else deleted once old enough),
        forget recorded vPods the backend does not have."""
        listed = await with_retries(lambda: self.backend.list(
            {"neuscale-cluster": self.cfg.cluster}))
        have = {i.spec.id: i for i in listed}
        for vid, row in list(self.vpods.items()):
            info = have.get(vid)
            if info is None or info.state == VPodState.RELEASED:
                self._forget(row, "not found in the backend on restart")
                continue
            self._event("adopt", vid, f"on restart: {info.state} in the backend, "
                        f"{row.state} in the state")
            if row.state == VPodState.DRAINING:
                self._spawn(self._drain_and_delete(row))
            elif info.state == VPodState.READY:
                self._mark_ready(row, info)
            else:
                self._spawn(self._await_ready(row))
        for vid, info in have.items():
            if vid in self.vpods or info.state in (VPodState.RELEASED, VPodState.DRAINING):
                continue
            age_cp = (time.time() - info.created_s) * self.cfg.time_scale
            if age_cp >= self.cfg.orphan_grace_s or self._recorded_released(vid):
                self._event("delete", vid, "orphan: this cluster's label, not in the state")
                self._spawn(self._delete_quietly(vid))

    def _recorded_released(self, vid: str) -> bool:
        return any(v.id == vid for v in self.state.vpods([VPodState.RELEASED]))

    async def run(self) -> None:
        """Sample every ``sample_s`` (control-plane), plan every ``epoch_s`` or sooner."""
        pcfg = self.cfg.policy
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), self.wall(pcfg.sample_s))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self._stopping:
                break
            try:
                await self.sample()
                due = self.now_cp() - self._last_epoch_cp >= pcfg.epoch_s
                if due or self._cold():
                    self.epoch()
                else:
                    self.emergencies()
            except Exception:            # a bug in one round must not stop the controller
                log.exception("controller round failed")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ---- observe ------------------------------------------------------------------------------
    async def sample(self) -> None:
        """One 10-s (control-plane) sample: token rates per bucket from the gateway, queues
        from the gateway and the engines, health of every ready vPod."""
        now = time.monotonic()
        dt_wall = max(now - self._last_sample, 1e-6)
        self._last_sample = now
        s = self.gateway.take_samples()
        if self._log_buf:
            buf, self._log_buf = self._log_buf, []
            self.state.log_requests(buf)
        for ph in PHASES:
            self.window.record(ph, s.tokens[ph] / dt_wall)
        queue = dict(s.waiting)          # a group's aggregated queue (§3.4): the gateway's
        for (ph, g), x in s.longest_s.items():
            self.window.note_duration(ph, g, x)
        for (ph, b), (x, n) in s.stay_s.items():
            self.window.note_stay(ph, b, x, n)
        ready = [v for v in self.vpods.values() if v.state == VPodState.READY]
        results = await asyncio.gather(*(self._scrape(v) for v in ready))
        for v, (ok, waiting) in zip(ready, results):
            if ok:
                self._health_fail.pop(v.id, None)
                queue[(v.phase, v.grp)] = queue.get((v.phase, v.grp), 0) + waiting
            else:
                n = self._health_fail[v.id] = self._health_fail.get(v.id, 0) + 1
                if n >= self.cfg.health_failures:
                    self._dead(v)
        for (ph, g), n in queue.items():     # and its engines' waiting requests
            if n:
                self.window.note_queue(ph, g, n)

    def vpod_failed(self, vid: str) -> None:
        """The gateway saw ``vid`` fail under a request: check it now, not at the next
        sample, and replace it at once if it does not answer (a group whose only vPod died
        gets its replacement started while the request waits for it)."""
        v = self.vpods.get(vid)
        if v is None or v.state != VPodState.READY or vid in self._checking:
            return
        self._checking.add(vid)

        async def check() -> None:
            try:
                ok, _ = await self._scrape(v)
                if not ok and self.vpods.get(vid) is v and v.state == VPodState.READY:
                    self._dead(v, "failed under a request and /metrics does not answer")
            finally:
                self._checking.discard(vid)
        self._spawn(check())

    async def _scrape(self, v: VPodRow) -> tuple[bool, int]:
        """(healthy, requests waiting) from the engine's /metrics (vLLM's names)."""
        try:
            async with self._session.get(f"{v.endpoint}/metrics") as r:
                if r.status != 200:
                    return False, 0
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False, 0
        if self.recal is not None and v.state == VPodState.READY:
            self.recal.observe(v.id, (v.chip, v.topology, v.tp, v.pp, v.ep, v.attn, v.phase),
                               text)
        return True, int(_metric(text, "vllm:num_requests_waiting"))

    def _cold(self) -> bool:
        """Traffic and no routing yet (a cold start): plan now."""
        return self.planned["prefill"] is None and bool(self.window.samples("prefill").any())

    def _inventory(self, phase: str) -> list[VPodRecord]:
        return [VPodRecord(v.id, v.grp, v.chip, v.topology, v.num_chips, VPodState(v.state),
                           v.failover, v.throughput_tok_per_s, v.max_batch)
                for v in self.vpods.values()
                if v.phase == phase and v.state in (VPodState.STARTING, VPodState.READY)]

    # ---- plan ---------------------------------------------------------------------------------
    def epoch(self) -> None:
        now_cp = self.now_cp()
        self._last_epoch_cp = now_cp
        self._recalibrate()
        self._gate.new_epoch()
        for ph in PHASES:
            inv = self._inventory(ph)
            urgent = self._gate.due(ph, self.policies[ph], self.window.peak_queue[ph], inv,
                                    at_epoch=True)
            plan = self.policies[ph].plan(self._observe(ph, inv, now_cp), self.pstate[ph])
            # no group at all (no traffic in the window): no table, the gateway answers 503
            # with Retry-After and counts the demand, which makes the next round plan again
            self.planned[ph] = plan.routing if plan.groups else None
            self.state.set_json(f"routing:{ph}", _table_to_json(plan.routing)
                                if plan.groups else None)
            self._carry_out(ph, plan, urgent)
        self.window.end_epoch()
        self._publish()

    def emergencies(self) -> None:
        """Between epochs (every sample): a group whose aggregated queue is an emergency by
        its policy gets the emergency scale-out now, once per start-up of what it ordered
        (:class:`orchestrator.policy.EmergencyGate`, as the simulator); the routing, the epoch's
        cadence and every other group stay as the epoch left them."""
        now_cp = self.now_cp()
        for ph in PHASES:
            inv = self._inventory(ph)
            urgent = self._gate.due(ph, self.policies[ph], self.window.queue_now[ph], inv)
            if urgent:
                self._carry_out(ph, self.policies[ph].plan_emergency(
                    self._observe(ph, inv, now_cp, epoch=False), self.pstate[ph], urgent),
                    urgent)

    def _observe(self, phase: str, inv: list[VPodRecord], now_cp: float, epoch: bool = True):
        return self.window.observe(phase, now_cp, inv, self._quotas(now_cp),
                                   chips_in_use((v.chip, v.num_chips)
                                                for v in self.vpods.values()), epoch)

    def _carry_out(self, phase: str, plan: Plan, urgent: list[str]) -> None:
        """Keep a plan's policy state and record (the state file), actuate it, and tell the
        gate which emergencies it acted on."""
        self.pstate[phase] = plan.state
        self.state.set_json(f"policy_state:{phase}", _policy_state_to_json(plan.state))
        self.state.add_plan(time.time(), phase, [_action_json(a) for a in plan.actions],
                            plan.target, plan.rates)
        self._act(phase, plan)
        self._gate.acted(phase, urgent, self._inventory(phase))
        self.state.set_json("emergency_gate", self._gate.to_json())

    def _recalibrate(self) -> None:
        """Fold the epoch's measured latencies into the correction factors (before the
        policies plan with them), keep them in the state, and say which moved."""
        if self.recal is None:
            return
        moved = self.recal.update()
        if not moved:
            return
        self.state.set_json("calibration", self.recal.calibration.to_json())
        for (chip, topo, tp, pp, ep, attn, phase), f in moved.items():
            lay = LAYOUT_SUFFIX.get(attn, f"-{attn}")
            self._event("recalibrate", f"{phase} {chip}:{topo} tp{tp}-pp{pp}-ep{ep}{lay}",
                        f"measured / modelled latency -> factor {f:.2f}")

    def _quotas(self, now_cp: float) -> dict[str, int]:
        """Known quotas, tightened by limits learned from quota errors (kept for a while: a
        stock-out ends, and then best fits replace fail-overs)."""
        q = dict(self.cfg.quotas)
        for chip, (limit, since) in list(self.learned_quota.items()):
            if now_cp - since > self.cfg.quota_memory_s:
                del self.learned_quota[chip]
                continue
            q[chip] = min(q.get(chip, limit), limit)
        return q

    # ---- act ----------------------------------------------------------------------------------
    def _act(self, phase: str, plan: Plan) -> None:
        for a in plan.actions:
            if a.kind == ActionKind.CREATE:
                e = self._entry(phase, a.chip, a.topology) if a.failover \
                    else plan.groups[a.group].entry
                self._create(phase, a.group, e, a.failover, a.reason)
            elif a.kind == ActionKind.DELETE and a.vpod_id in self.vpods:
                v = self.vpods[a.vpod_id]
                if v.state != VPodState.READY:
                    self._start_drain(v, a.reason)
                    continue
                # make before break: it drains once its group hands no bucket over (_publish)
                if v.reason.startswith(HELD):
                    continue                  # said before: the plan repeats it each epoch
                v.reason = f"{HELD} ({a.reason})"
            elif a.kind == ActionKind.REPLACE and a.vpod_id in self.vpods:
                e = plan.groups[a.group].entry
                self._create(phase, a.group, e, False, a.reason, replaces=a.vpod_id)
            if a.kind != ActionKind.CREATE or a.count:
                self._event(str(a.kind), a.vpod_id or a.group, a.reason)

    def _entry(self, phase: str, chip: str, topology: str) -> Entry:
        for e in self.db.entries:
            if e.phase == phase and e.chip == chip and e.topology == topology and e.feasible:
                return e
        raise LookupError(f"no {phase} entry on {chip}:{topology}")

    def _create(self, phase: str, group: str, e: Entry, failover: bool, reason: str,
                replaces: str | None = None) -> VPodRow:
        self._n += 1
        vid = f"{self.cfg.cluster}-{phase[0]}{self._n:04d}-{random.randrange(16 ** 4):04x}"
        row = VPodRow(vid, group, phase, e.chip, e.topology, e.num_chips, e.tp, e.pp, e.ep,
                      e.max_batch, self.cfg.max_model_len, e.throughput_tok_per_s,
                      failover, VPodState.STARTING, None, time.time(), reason=reason,
                      attn=e.attn)
        # recorded before the backend hears of it: a crash from here on leaves a trace
        self.state.add_vpod(row)
        self.vpods[vid] = row
        self._spawn(self._create_remote(row, replaces))
        return row

    def _spec(self, v: VPodRow) -> VPodSpec:
        return vpod_spec(self.cfg, v.id, v.grp, v.phase, v.chip, v.topology, v.num_chips,
                         v.tp, v.pp, v.ep, v.max_batch, v.max_model_len, attn=v.attn)

    async def _create_remote(self, v: VPodRow, replaces: str | None) -> None:
        try:
            async with self._sem:
                await with_retries(lambda: self.backend.create(self._spec(v)))
        except QuotaError as e:
            held = sum(x.num_chips for x in self.vpods.values()
                       if x.chip == v.chip and x.id != v.id)
            self.learned_quota[v.chip] = (held, self.now_cp())
            self._forget(v, f"quota: {e}")
            self._wake_for_plan()          # re-plan now: the policy fails over
            return
        except (ConfigError, BackendError) as e:
            self._forget(v, f"create failed: {e}")
            return
        await self._await_ready(v)
        if replaces and replaces in self.vpods and self.vpods[v.id].state == VPodState.READY:
            self._start_drain(self.vpods[replaces], f"replaced by {v.id}")

    async def _await_ready(self, v: VPodRow) -> None:
        try:
            info = await self.backend.wait_ready(v.id, timeout_s=self.wall(3600.0) + 30.0)
        except BackendError as e:
            self._forget(v, f"never became ready: {e}")
            await self._delete_quietly(v.id)
            return
        if v.state == VPodState.STARTING:
            self._mark_ready(v, info)
            self._publish()

    def _mark_ready(self, v: VPodRow, info: VPodInfo) -> None:
        v.state, v.endpoint = VPodState.READY, info.endpoint
        v.ready_at = info.ready_s or time.time()
        self.state.update_vpod(v.id, state=v.state, endpoint=v.endpoint, ready_at=v.ready_at)

    def _start_drain(self, v: VPodRow, reason: str) -> None:
        if v.state in (VPodState.DRAINING, VPodState.RELEASED):
            return
        v.state, v.reason = VPodState.DRAINING, reason
        self.state.update_vpod(v.id, state=v.state, reason=reason)
        self._publish()                      # the gateway stops sending to it
        self._spawn(self._drain_and_delete(v))

    async def _drain_and_delete(self, v: VPodRow) -> None:
        """Wait until nothing is in flight on the vPod (the gateway's count and the engine's
        running and waiting requests), then delete it."""
        deadline = time.monotonic() + self.wall(self.cfg.drain_timeout_s)
        while time.monotonic() < deadline and await self._busy(v):
            await asyncio.sleep(min(0.5, self.wall(self.cfg.policy.sample_s)))
        await self._delete_quietly(v.id)
        self._release(v, v.reason or "deleted")

    async def _busy(self, v: VPodRow) -> bool:
        if self.gateway.outstanding(v.id):
            return True
        if not v.endpoint:
            return False
        try:
            async with self._session.get(f"{v.endpoint}/metrics") as r:
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False                     # unreachable: nothing left to wait for
        return (_metric(text, "vllm:num_requests_running")
                + _metric(text, "vllm:num_requests_waiting")) > 0

    async def _delete_quietly(self, vid: str) -> None:
        try:
            async with self._sem:
                await with_retries(lambda: self.backend.delete(vid))
        except BackendError as e:
            log.warning("deleting %s failed: %s", vid, e)

    def _dead(self, v: VPodRow, why: str = "") -> None:
        """A vPod that stopped answering: out of routing, deleted, replaced at once."""
        self._event("replace", v.id, "dead: " + (
            why or f"/metrics failed {self.cfg.health_failures} times"))
        self._health_fail.pop(v.id, None)
        e = self._entry(v.phase, v.chip, v.topology)
        self._release(v, "dead")
        self._spawn(self._delete_quietly(v.id))
        self._create(v.phase, v.grp, e, v.failover, f"replaces dead {v.id}")

    def _release(self, v: VPodRow, reason: str) -> None:
        if self.recal is not None:
            self.recal.forget(v.id)
        v.state, v.reason, v.released_at = VPodState.RELEASED, reason, time.time()
        self.state.update_vpod(v.id, state=v.state, reason=reason, released_at=v.released_at)
        self.vpods.pop(v.id, None)
        self._publish()

    def _forget(self, v: VPodRow, reason: str) -> None:
        self._event("forget", v.id, reason)
        self._release(v, reason)

    def _wake_for_plan(self) -> None:
        self._last_epoch_cp = -math.inf
        self._wake.set()

    # ---- routing ------------------------------------------------------------------------------
    def _publish(self) -> None:
        """Hand the gateway its routing tables (make-before-break) and the ready vPods per
        group; a deleted vPod (and every vPod of an evicted group) drains once its group hands
        no bucket over (:func:`router.routing.handing_over`)."""
        ready = {}
        starting: set[tuple[str, str]] = set()
        for v in self.vpods.values():
            if v.state == VPodState.READY:
                ready.setdefault((v.phase, v.grp), []).append(
                    Endpoint(v.id, v.endpoint, v.throughput_tok_per_s, v.max_batch))
            elif v.state == VPodState.STARTING:
                starting.add((v.phase, v.grp))
        for ph in PHASES:
            planned = self.planned[ph]
            self.routing[ph] = None if planned is None else make_before_break(
                planned, self.routing[ph],
                lambda g, ph=ph: (ph, g) in ready and (ph, g) not in starting)
        giving = {(ph, g) for ph, t in self.routing.items()
                  for g in handing_over(t, self.planned[ph])}
        for v in list(self.vpods.values()):
            planned = self.planned[v.phase]
            if v.state == VPodState.READY and (planned is None or v.grp not in planned.groups
                                               or v.reason.startswith(HELD)) \
                    and (v.phase, v.grp) not in giving:
                self._start_drain(v, v.reason if v.reason.startswith(HELD)
                                  else "evicted group: nothing routes to it")
                return                                  # _start_drain publishes again
        self.gateway.set_targets({ph: t for ph, t in self.routing.items() if t is not None},
                                 ready, starting)

    # ---- status -------------------------------------------------------------------------------
    def _event(self, kind: str, what: str, reason: str) -> None:
        self.events.append({"t": time.time(), "kind": kind, "what": what, "reason": reason})
        del self.events[:-200]

    def status(self) -> dict[str, Any]:
        groups: dict[str, dict[str, Any]] = {}
        for v in self.vpods.values():
            g = groups.setdefault(f"{v.phase}/{v.grp}", {"phase": v.phase, "group": v.grp,
                                                        "vpods": 0, "ready": 0})
            g["vpods"] += 1
            g["ready"] += v.state == VPodState.READY
        routing = {ph: ({str(e): g for e, g in zip(t.edges, t.groups)} if t else None)
                   for ph, t in self.routing.items()}
        best_len = {ph: (dict(t.best_len) if t else {}) for ph, t in self.routing.items()}
        return {
            "time_scale": self.cfg.time_scale,
            "groups": list(groups.values()),
            "vpods": [{"id": v.id, "phase": v.phase, "group": v.grp, "chip": v.chip,
                       "topology": v.topology, "num_chips": v.num_chips, "state": str(v.state),
                       "failover": v.failover, "endpoint": v.endpoint,
                       "in_flight": self.gateway.outstanding(v.id), "reason": v.reason}
                      for v in self.vpods.values()],
            "routing": routing,
            "best_len": best_len,
            "recent_actions": self.events[-30:][::-1],
            "calibration": self.recal.calibration.to_json() if self.recal is not None else None,
            "recent_plans": self.state.recent_plans(6),
        }


# ---- helpers ----------------------------------------------------------------------------------

def vpod_spec(cfg: ControllerConfig, vid: str, group: str, phase: str, chip: str,
              topology: str, num_chips: int, tp: int, pp: int, ep: int, max_batch: int,
              max_model_len: int, attn: str = "dp") -> VPodSpec:
    """What the backend is asked to create for a vPod of this cluster (labels included)."""
    return VPodSpec(id=vid, group=group, phase=phase, model=cfg.model, chip=chip,
                    topology=topology, num_chips=num_chips, tp=tp, pp=pp, ep=ep, attn=attn,
                    max_batch=max_batch, max_model_len=max_model_len,
                    labels={"neuscale-cluster": cfg.cluster, "neuscale-vpod": vid,
                            "neuscale-group": label_value(group), "neuscale-phase": phase})


def record_bootstrap(window: ObservationWindow, edges, lengths: tuple[int, int]) -> None:
    """The bootstrap's sample: 1 token/s in the bucket of a typical input (prefill) and of a
    typical input + output (decode)."""
    from router.routing import bucket_indices
    import numpy as np
    nb = len(edges)
    for ph, length in zip(PHASES, lengths):
        s = np.zeros(nb)
        s[int(bucket_indices(edges, np.array([length]))[0])] = 1.0
        window.record(ph, s)


def first_plans(db: BestFitDB, policies: Mapping[str, Policy],
                cfg: ControllerConfig) -> dict[str, Plan]:
    """The plans a controller with no vPods makes at start (``bootstrap``), per phase: what
    ``serve --dry-run`` shows. Pure: nothing is created."""
    window = ObservationWindow(len(db.edges), cfg.policy)
    record_bootstrap(window, db.edges, cfg.bootstrap_lengths)
    out = {}
    for ph in PHASES:
        obs = window.observe(ph, 0.0, [], dict(cfg.quotas), chips_in_use([]))
        out[ph] = policies[ph].plan(obs, PolicyState())
    return out


def _metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) in exposition text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                pass
    return total


def _action_json(a) -> dict[str, Any]:
    return {"kind": str(a.kind), "group": a.group, "reason": a.reason, "chip": a.chip,
            "topology": a.topology, "count": a.count, "vpod_id": a.vpod_id,
            "failover": a.failover}


def _table_to_json(t: RoutingTable) -> dict[str, Any]:
    return {"edges": list(t.edges), "groups": list(t.groups), "best_len": dict(t.best_len)}


def _table_from_json(d: dict[str, Any]) -> RoutingTable:
    return RoutingTable(tuple(d["edges"]), tuple(d["groups"]), dict(d["best_len"]))


def _policy_state_to_json(s: PolicyState) -> dict[str, Any]:
    from dataclasses import asdict
    return {"groups": {g: {"ewma_peak": gs.ewma_peak,
                           "last_shrink_s": gs.last_shrink_s if math.isfinite(gs.last_shrink_s)
                           else None, "queued": gs.queued,
                           "queued_since_s": gs.queued_since_s
                           if math.isfinite(gs.queued_since_s) else None,
                           "epoch_vpods": gs.epoch_vpods}
                       for g, gs in s.groups.items()},
            "chosen": {str(i): g for i, g in s.chosen.items()},
            "allocs": {g: _finite(asdict(spec.entry)) for g, spec in s.allocs.items()},
            "pending": {str(k): list(v) for k, v in s.pending.items()}}


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in d.items()}


def _policy_state_from_json(d: dict[str, Any]) -> PolicyState:
    """The policy's memory as saved; a state file from before the load-aware policy (groups
    only, at the top level) still loads."""
    from dse.db import Entry

    from .policy import GroupSpec, GroupState
    groups = d.get("groups", d) if isinstance(d.get("groups"), dict) else d
    out = PolicyState({g: GroupState(v["ewma_peak"], -math.inf if v["last_shrink_s"] is None
                                     else v["last_shrink_s"], bool(v.get("queued", False)),
                                     math.inf if v.get("queued_since_s") is None
                                     else v["queued_since_s"], int(v.get("epoch_vpods", 0)))
                       for g, v in groups.items()})
    if "chosen" in d:
        out.chosen = {int(i): g for i, g in d["chosen"].items()}
        out.allocs = {g: GroupSpec(g, Entry(**{k: (math.inf if v is None else v)
                                               for k, v in e.items()}))
                      for g, e in d["allocs"].items()}
        out.pending = {int(k): tuple(v) for k, v in d["pending"].items()}
    return out


__all__ = ["Controller", "ControllerConfig", "available_chips"]
