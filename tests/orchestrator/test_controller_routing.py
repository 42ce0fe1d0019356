"""The wall-clock controller's make-before-break: what it hands the gateway while a plan that
moves buckets to another group is actuated (real gateway object, real SQLite state)."""
import asyncio
import math

from orchestrator.controller import Controller
from orchestrator.state import StateStore, VPodRow
from router.gateway import Gateway
from router.routing import RoutingTable


def row(vid, grp, state):
    return VPodRow(vid, grp, "decode", "v6e", "2x2", 4, 4, 1, 1, 8, 4096, 1e4, False, state,
                   f"http://127.0.0.1:1/{vid}" if state == "ready" else None, 0.0)


def test_the_gateway_keeps_a_bucket_on_its_old_group_until_the_new_ones_vpods_are_all_up(
        tmp_path, llama8b_db):
    """One ready vPod of the new group is not the capacity the plan ordered: the bucket stays
    where three running vPods serve it until the new group's starting vPod is up too."""
    db = llama8b_db[0]

    async def go():
        gw = Gateway("llama3-8b", db.edges, 8192)
        c = Controller(db, None, gw, StateStore(tmp_path / "state.db"))
        last = len(db.edges) - 1
        c.vpods = {v.id: v for v in [row(f"old{k}", "old", "ready") for k in range(3)]
                   + [row("new0", "new", "ready"), row("new1", "new", "starting")]}
        c.routing["decode"] = RoutingTable.build({last: "old"}, db.edges)
        c.planned["decode"] = RoutingTable.build({last: "new"}, db.edges)
        c._publish()
        held = set(c.routing["decode"].groups)
        c.vpods["new1"] = row("new1", "new", "ready")
        c._publish()
        return held, set(c.routing["decode"].groups)
    held, moved = asyncio.run(go())
    assert held == {"old"} and moved == {"new"}


def test_a_scale_in_drains_only_once_its_groups_hand_off_is_done(tmp_path, llama8b_db):
    """The plan moves the short buckets of a running group to a group still starting and
    deletes two of the old group's three vPods: they keep serving (and the gateway keeps them)
    until the new group is up, then drain; the third, not deleted, stays."""
    from orchestrator.controller import HELD
    from orchestrator.policy import Action, ActionKind, Plan, PolicyState
    db = llama8b_db[0]

    async def go():
        gw = Gateway("llama3-8b", db.edges, 8192)
        c = Controller(db, None, gw, StateStore(tmp_path / "state.db"))
        last = len(db.edges) - 1
        c.vpods = {v.id: v for v in [row(f"old{k}", "old", "ready") for k in range(3)]
                   + [row("new0", "new", "starting")]}
        c.routing["decode"] = RoutingTable.build({last: "old"}, db.edges)
        c.planned["decode"] = planned = RoutingTable.build({0: "new", last: "old"}, db.edges)
        c._act("decode", Plan([Action(ActionKind.DELETE, "old", "scale in", vpod_id=f"old{k}")
                               for k in (1, 2)], planned, PolicyState(), {}, {}, {}))
        c._publish()
        during = {k: (v.state, v.reason) for k, v in c.vpods.items()}
        c.vpods["new0"] = row("new0", "new", "ready")
        c._publish()
        return during, {k: v.state for k, v in c.vpods.items()}, c.routing["decode"].groups
    during, after, groups = asyncio.run(go())
    assert all(s == "ready" for s, _ in during.values() if s != "starting")
    assert during["old1"][1].startswith(HELD) and during["old2"][1].startswith(HELD)
    assert not during["old0"][1].startswith(HELD)
    assert after["old1"] == after["old2"] == "draining" and after["old0"] == "ready"
    assert groups[0] == "new" and groups[-1] == "old"


def test_the_controller_plans_at_once_only_on_the_emergency_its_policy_would_act_on(
        tmp_path, llama8b_db):
    """A load-aware prefill group's prompts may wait their SLO's slack, so its queue is an
    emergency only past its slots x (1 + slack): a queue between the two does not make the
    controller plan between epochs (each such plan would count as an epoch for the re-choice
    hold); one past it does. The paper's rule tolerates no queue beyond the slots."""
    import numpy as np

    from orchestrator.loadaware import LoadAwarePolicy
    from orchestrator.policy import Observation, Policy
    db = llama8b_db[0]
    i = 7                                                     # prompts <= 1024 tokens
    aware = LoadAwarePolicy(db, "prefill")
    rate = 0.5 * db.entry_at("prefill", i).throughput_tok_per_s
    plan = aware.plan(Observation(0.0, {i: np.full(180, rate)}))
    (g,) = plan.target
    tolerance = aware._queue_tolerance(g)
    assert tolerance > 1.5                                    # a short prompt has slack
    e = plan.groups[g].entry

    def urgent(policy, queue):
        async def go():
            gw = Gateway("llama3-8b", db.edges, 8192)
            c = Controller(db, None, gw, StateStore(tmp_path / f"s{queue}{id(policy)}.db"),
                           policies={"prefill": policy, "decode": Policy(db, "decode")})
            c.vpods = {f"p{k}": VPodRow(f"p{k}", g, "prefill", e.chip, e.topology,
                                        e.num_chips, 1, 1, 1, e.max_batch, 8192,
                                        e.throughput_tok_per_s, False, "ready",
                                        f"http://127.0.0.1:1/p{k}", 0.0)
                       for k in range(plan.target[g])}
            c.planned["prefill"] = plan.routing
            c.window.peak_queue["prefill"][g] = queue
            return c._gate.due("prefill", policy, c.window.peak_queue["prefill"],
                               c._inventory("prefill")) == [g]
        return asyncio.run(go())

    slots = plan.target[g] * e.max_batch
    within = math.floor(slots * tolerance)
    assert not urgent(aware, slots + 1) and not urgent(aware, within)
    assert urgent(aware, within + 1)
    assert urgent(Policy(db, "prefill"), slots + 1)


def test_a_restarted_controller_keeps_its_routing_until_it_has_seen_an_epoch(
        tmp_path, llama8b_db):
    """The observation window is not in the state file. A controller restarted from it keeps
    the routing table and vPods it restored until an epoch of its own samples has passed:
    planning at its first sample (its last epoch unknown) planned over an empty window - no
    groups, so no routing table, every request a 503 until traffic made it plan again, and
    every adopted vPod scaled in. The wall-clock loop itself runs here (time compressed)."""
    import time

    import numpy as np

    from orchestrator.controller import ControllerConfig
    from orchestrator.policy import Policy, PolicyConfig
    db = llama8b_db[0]
    i = 20
    e = db.entry_at("prefill", i)
    cfg = ControllerConfig(time_scale=300.0)     # a 10-s sample every 33 ms, an epoch per s
    policies = {"prefill": Policy(db, "prefill"), "decode": Policy(db, "decode")}

    async def go():
        c = Controller(db, None, Gateway("llama3-8b", db.edges, 8192),
                       StateStore(tmp_path / "state.db"), cfg, policies=policies)
        c._spawn = lambda coro: coro.close()     # rows only: no backend starts anything
        load = np.zeros(len(db.edges))
        load[i] = 1.5 * e.throughput_tok_per_s
        for _ in range(30):
            c.window.record("prefill", load)
            c.window.record("decode", np.zeros(len(db.edges)))
        c.epoch()
        table, vpods = c.planned["prefill"], set(c.vpods)
        assert table is not None and vpods
        again = Controller(db, None, Gateway("llama3-8b", db.edges, 8192), c.state, cfg,
                           policies=policies)
        again._spawn = lambda coro: coro.close()
        again._restore()
        run = asyncio.ensure_future(again.run())
        t0 = time.monotonic()
        seen = []
        # a third of an epoch: a dozen samples, no traffic
        while time.monotonic() - t0 < 0.3 * cfg.policy.epoch_s / cfg.time_scale:
            seen.append((again.planned["prefill"], set(again.vpods)))
            await asyncio.sleep(0.01)
        kept = again.planned["prefill"]
        # and once an epoch of its own samples (all without traffic) has passed, it plans
        while again.planned["prefill"] is not None and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.01)
        await again.stop()
        await run
        return table, vpods, seen, kept, again.planned["prefill"]
    table, vpods, seen, kept, last = asyncio.run(go())
    assert len(seen) >= 10
    assert all(t is not None and t.groups == table.groups and v == vpods for t, v in seen)
    assert kept is not None and last is None
