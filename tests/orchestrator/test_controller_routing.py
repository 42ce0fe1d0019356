"""The wall-clock controller's make-before-break: what it hands the gateway while a plan that
moves buckets to another group is actuated (real gateway object, real SQLite state)."""
import asyncio

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
