"""§3.4's emergency scale-out between epochs: "this reactive scale-out bypasses the doubling
constraint to quickly absorb workload spikes" - and a spike does not wait for the epoch. Both
drivers ask an :class:`EmergencyGate` every sample and plan the emergency at once
(:meth:`Policy.plan_emergency`), at most once per start-up of what they ordered; the queue is
the group's aggregated one (all its vPods' and its router queue)."""
import asyncio

import numpy as np
import pytest

from dse import load_model
from dse.vpod import VPodState
from orchestrator.cluster import ClusterConfig, ClusterSim
from orchestrator.cluster import simulator as simulator_mod
from orchestrator.loadaware import LoadAwarePolicy
from orchestrator.policy import EmergencyGate, Observation, Policy, PolicyConfig, VPodRecord
from orchestrator.pricing import ChipModelPricer
from orchestrator.registry import make_policies

N = 180
ARCH = load_model("llama3-8b")


@pytest.fixture(scope="module")
def db(llama8b_db):
    return llama8b_db[0]


def flat(x, n=N):
    return np.full(n, float(x))


def running(plan, g, state="ready", start=0):
    e = plan.groups[g].entry
    return [VPodRecord(f"{g}#{start + k}", g, e.chip, e.topology, e.num_chips, state,
                       throughput_tok_per_s=e.throughput_tok_per_s, max_batch=e.max_batch)
            for k in range(sum(a.count for a in plan.actions
                               if a.kind == "create" and a.group == g))]


def creates(plan):
    return {a.group: a.count for a in plan.actions if a.kind == "create"}


def test_an_emergency_plan_scales_out_only_the_groups_in_emergency(db):
    """Between epochs only the emergency rule acts: a group whose load grew 10x gets the
    extra slots its queue needs, not the epoch's doubling; another group whose load fell is
    not scaled in, its state (EWMA of peaks) not touched; nothing is merged or evicted."""
    pol = Policy(db, "decode", PolicyConfig(coalescing=False))
    a, b = 20, 30
    ta = db.entry_at("decode", a).throughput_tok_per_s
    tb = db.entry_at("decode", b).throughput_tok_per_s
    first = pol.plan(Observation(0.0, {a: flat(1.5 * ta), b: flat(3.5 * tb)}))
    ga, gb = (first.routing.group_for_length(db.edges[i]) for i in (a, b))
    assert ga != gb
    inv = running(first, ga) + running(first, gb)
    na = first.target[ga]
    slots_a = na * first.groups[ga].entry.max_batch
    mb = first.groups[ga].entry.max_batch
    # 10 x the load on a, a tenth on b, a queue of one batch beyond a's slots
    obs = Observation(310.0, {a: np.concatenate([flat(1.5 * ta, N - 3), flat(15 * ta, 3)]),
                              b: np.concatenate([flat(3.5 * tb, N - 3), flat(0.3 * tb, 3)])},
                      inv, group_peak_queue={ga: slots_a + mb})
    full = pol.plan(obs, first.state)
    assert full.target[ga] == 2 * na                     # the epoch's rule: x2
    p = pol.plan_emergency(obs, first.state, [ga])
    assert creates(p) == {ga: 1}                          # one batch more: one vPod
    assert all(a.kind in ("create", "unsatisfied") and a.group == ga for a in p.actions)
    assert any("emergency: peak queue" in line for line in p.explain())
    assert p.state.groups[gb] == first.state.groups[gb]
    assert p.state.groups[ga].ewma_peak == first.state.groups[ga].ewma_peak
    assert p.target == {ga: na + 1}


def test_an_emergency_plan_does_not_count_as_an_epoch_for_the_rechoice_hold(db):
    """The load-aware policy re-chooses only when a cheaper grouping has been the cheaper one
    for ``rechoose_epochs`` epochs: a plan between epochs neither counts nor re-chooses, it
    scales out what runs."""
    pricer = ChipModelPricer(ARCH, __import__("dse").default_catalog())
    i, low = 4, 1000.0
    pol = LoadAwarePolicy(db, "decode", pricer=pricer)
    first = pol.plan(Observation(0.0, {i: flat(low)}))
    (g0,) = first.target
    inv = running(first, g0)
    high = next(r for r in (1e6, 3e6, 1e7) if set(LoadAwarePolicy(
        db, "decode", pricer=pricer).plan(Observation(0.0, {i: flat(r)})).target) != {g0})
    step = {i: np.concatenate([flat(low, N - 30), flat(high, 30)])}
    at_epoch = pol.plan(Observation(300.0, step, inv), first.state)
    assert set(at_epoch.target) == {g0} and at_epoch.state.pending     # one epoch counted
    inv = inv + running(at_epoch, g0, start=len(inv))
    slots = sum(v.max_batch for v in inv)
    urgent = Observation(330.0, {i: flat(high)}, inv, group_peak_queue={g0: 3 * slots})
    p = pol.plan_emergency(urgent, at_epoch.state, [g0])
    assert p.state.pending == at_epoch.state.pending                    # not counted
    assert set(p.target) == {g0} and creates(p).get(g0, 0) > 0
    assert p.routing.group_for_length(db.edges[i]) == g0                # what runs
    assert not any(a.kind == "choose_allocation" and "re-chosen" in a.reason
                   for a in p.actions)


def _rec(vid, state, group="g", batch=4):
    return VPodRecord(vid, group, "v5e", "2x2", 4, state, max_batch=batch)


def test_the_gate_plans_an_emergency_once_per_start_up(db):
    """Every sample a driver asks the gate; after a plan acted on a group's emergency the
    group waits until the vPods it had starting then are up (a plan before then could only
    order more for the same queue), or, if that plan could order nothing, until the epoch."""
    pol = Policy(db, "decode")                           # tolerance 1: any queue past the slots
    gate = EmergencyGate()
    ready = [_rec("r0", VPodState.READY), _rec("r1", VPodState.READY)]    # 8 slots
    assert gate.due("decode", pol, {"g": 8}, ready) == []
    assert gate.due("decode", pol, {"g": 9}, ready) == ["g"]
    starting = ready + [_rec("s0", VPodState.STARTING)]
    gate.acted("decode", ["g"], starting)
    for q in (13, 100, 10_000):                           # s0 on its way: no second plan
        assert gate.due("decode", pol, {"g": q}, starting) == []
    assert gate.due("prefill", pol, {"g": 100}, starting) == ["g"]   # per phase
    up = ready + [_rec("s0", VPodState.READY)]            # s0 is up: 12 slots
    assert gate.due("decode", pol, {"g": 12}, up) == []
    assert gate.due("decode", pol, {"g": 100}, up) == ["g"]
    gate.acted("decode", ["g"], up)                       # ordered nothing (quota): the epoch
    assert gate.due("decode", pol, {"g": 100}, up) == []
    assert gate.due("decode", pol, {"g": 100}, up, at_epoch=True) == ["g"]
    gate.new_epoch()
    assert gate.due("decode", pol, {"g": 100}, up) == ["g"]
    assert gate.due("decode", Policy(db, "decode", PolicyConfig(emergency=False)),
                    {"g": 100}, up) == []


def _step_trace(seed=0):
    """Llama3-8B prompts of 3-4 K tokens at 1 req/s, then from 400 s to 700 s at 40 req/s
    (about twice what one v6e-1 prefill vPod takes): a step in the middle of the 300-600 s
    epoch."""
    rng = np.random.default_rng(seed)
    arr = np.sort(np.concatenate([rng.uniform(0, 900, 900), rng.uniform(400, 700, 12_000)]))
    return arr, rng.integers(3000, 4000, len(arr)), rng.integers(2, 20, len(arr))


def _run(db, monkeypatch=None, between=True):
    arr, inp, out = _step_trace()
    cfg = ClusterConfig(seed=1)
    sim = ClusterSim(ARCH, db, make_policies("neuscale-paper", db, cfg.policy, inp, out), cfg)
    if not between:
        monkeypatch.setattr(sim, "_emergencies", lambda now: None)
    return sim, sim.run(arr, inp, out)


def test_the_simulator_scales_out_on_an_emergency_between_epochs(db, monkeypatch):
    """A step at 400 s: the simulator (like the controller) plans the emergency within a
    sample or two of the queue, not at the 600-s epoch, once per start-up of what it
    ordered, and the step's prompts meet their TTFT SLO more often than when it waited."""
    plans = []
    real = simulator_mod.ClusterSim._emergencies

    def spy(self, now):
        before = self.emergency_plans
        real(self, now)
        if self.emergency_plans > before:
            plans.append(now)
    monkeypatch.setattr(simulator_mod.ClusterSim, "_emergencies", spy)
    sim, res = _run(db)
    assert plans and all(p % 300 != 0 for p in plans)
    assert 400 < plans[0] < 600
    created = [v.created_s for v in res.vpods if v.phase == "prefill"]
    assert any(400 < c < 600 for c in created)            # ordered before the epoch
    # no storm: a plan per group per start-up (a vPod starts in > 60 s here)
    assert all(b - a >= 60 for a, b in zip(plans, plans[1:]))
    monkeypatch.undo()
    _, waited = _run(db, monkeypatch, between=False)
    assert not any(400 < v.created_s < 600 for v in waited.vpods)
    step = (res.arrival_s >= 400) & (res.arrival_s < 700)
    ttft = [float(np.median(r.ttft_s[step])) for r in (res, waited)]
    assert ttft[0] < 0.5 * ttft[1], ttft          # the backlog of a start-up, not an epoch's


def test_the_simulators_queue_is_the_groups_aggregated_queue(db, monkeypatch):
    """§3.4: "the peak aggregated queue size of each vPod group" - the sum over its vPods
    and the requests parked at the router for it, not the longest queue of one vPod."""
    noted, expected, spread = [], [], []
    real_note = simulator_mod.ObservationWindow.note_queue
    real_sample = simulator_mod.ClusterSim._sample

    def note(self, phase, group, depth):
        noted[-1][(phase, group)] = depth
        real_note(self, phase, group, depth)

    def sample(self):
        want, per = {}, {}
        for v in self.fleet.active:
            if v.engine is not None and v.engine.num_waiting:
                k = (v.phase, v.group)
                want[k] = want.get(k, 0) + v.engine.num_waiting
                per[k] = per.get(k, 0) + 1
        for k, lst in self._router_q.items():
            if lst:
                want[k] = want.get(k, 0) + len(lst)
        expected.append(want)
        spread.append(max(per.values(), default=0))
        noted.append({})
        real_sample(self)
    monkeypatch.setattr(simulator_mod.ObservationWindow, "note_queue", note)
    monkeypatch.setattr(simulator_mod.ClusterSim, "_sample", sample)
    _run(db)
    assert noted == expected
    assert max(spread) >= 2               # some group queued on several vPods at once


def test_the_controller_plans_an_emergency_between_epochs_once_per_start_up(tmp_path, db):
    """The live driver: an epoch's plan starts a prefill group; a queue past its slots gets
    an emergency plan at once, without a new routing table or a new epoch; a bigger queue
    while that vPod starts gets none (the plan storm a backlog made: a plan every 10-s
    sample), nor does a controller restarted from the state file; once it is up, a sample
    without a queue calls no plan (the epoch's peak is the queue it served), and the next
    queue may grow the group to x4 of what the epoch began with, not beyond. (Rows only: no backend
    is asked to start anything here.)"""
    from orchestrator.controller import Controller
    from orchestrator.state import StateStore
    from router.gateway import Gateway
    i = 20
    e = db.entry_at("prefill", i)

    async def go():
        c = Controller(db, None, Gateway("llama3-8b", db.edges, 8192),
                       StateStore(tmp_path / "state.db"),
                       policies={"prefill": Policy(db, "prefill"),
                                 "decode": Policy(db, "decode")})
        c._spawn = lambda coro: coro.close()
        load = np.zeros(len(db.edges))
        load[i] = 1.5 * e.throughput_tok_per_s
        for _ in range(30):
            c.window.record("prefill", load)
            c.window.record("decode", np.zeros(len(db.edges)))
        c.epoch()
        (g,) = {v.grp for v in c.vpods.values()}

        def up():                                   # every vPod started is up
            for v in c.vpods.values():
                v.state, v.endpoint = VPodState.READY, f"http://127.0.0.1:1/{v.id}"
        up()
        c.epoch()                                   # an epoch with them running: steady
        table, epoch_cp = c.planned["prefill"], c._last_epoch_cp
        n0 = len(c.vpods)
        counts = []

        def urgent(queue):                          # a sample with this queue
            c.window.queue_now["prefill"] = {}
            c.window.note_queue("prefill", g, queue)
            c.emergencies()
            counts.append(len(c.vpods))
        urgent(n0 * e.max_batch)                   # at the slots: no emergency
        urgent(n0 * e.max_batch + 1)               # one past: one vPod more
        urgent(10_000)                             # it is starting: no second plan
        urgent(10_000)
        # a controller restarted from the state file waits for it too
        again = Controller(db, None, Gateway("llama3-8b", db.edges, 8192), c.state,
                           policies=c.policies)
        again._restore()
        assert again._gate.due("prefill", again.policies["prefill"], {g: 10_000},
                               again._inventory("prefill")) == []
        up()
        urgent(0)          # it is up and the queue served: the epoch's peak calls no plan
        assert c.window.peak_queue["prefill"][g] == 10_000
        urgent(10_000)                             # a queue again: up to x4 of the epoch's
        assert c.planned["prefill"] is table and c._last_epoch_cp == epoch_cp
        return n0, counts
    n0, counts = asyncio.run(go())
    assert n0 == 2
    assert counts == [n0, n0 + 1, n0 + 1, n0 + 1, n0 + 1, 4 * n0]
