"""The cluster simulator on small traces, through the production policy and routing."""
import numpy as np
import pytest

import orchestrator.policy
import router.routing
import sim.cluster as cluster
from dse import load_model
from orchestrator.policy import PolicyConfig
from sim.cluster import ClusterConfig, ClusterSim, ideal_report, make_policies

ARCH = load_model("llama3-8b")


def trace(n=300, seed=0, span=600.0, lo=100, hi=3000):
    rng = np.random.default_rng(seed)
    return (np.sort(rng.uniform(0, span, n)), rng.integers(lo, hi, n), rng.integers(2, 200, n))


def run(db, policy="neuscale", cfg=ClusterConfig(), tr=None):
    arr, inp, out = tr or trace()
    sim = ClusterSim(ARCH, db, make_policies(policy, db, cfg.policy, inp, out), cfg)
    return sim, sim.run(arr, inp, out)


@pytest.fixture(scope="module")
def db(llama8b_db):
    return llama8b_db[0]


def test_uses_the_production_policy_and_routing():
    assert cluster.Policy is orchestrator.policy.Policy
    assert cluster.RoutingTable is router.routing.RoutingTable


def test_every_request_is_served_and_accounted(db):
    sim, rep = run(db)
    assert not np.isnan(sim.ttft).any() and not np.isnan(sim.tpot).any()
    assert (sim.ttft > 0).all() and (sim.tpot > 0).all()
    p, d = rep["prefill"], rep["decode"]
    arr, inp, out = trace()
    assert p.requests == 300 and p.tokens == int(inp.sum()) and d.tokens == int((out - 1).sum())
    assert p.energy_j > 0 and d.energy_j > 0 and p.cost_usd > 0
    assert 0 < p.slo_met <= 300
    # dollars = chips x price x time held, summed over vPods
    usd = sum(v.num_chips * sim.catalog.get(v.chip).price_usd_per_chip_hour *
              ((v.released_s or sim_end(sim)) - v.created_s) / 3600
              for v in sim.vpods.values() if v.phase == "prefill")
    assert p.cost_usd == pytest.approx(usd, rel=1e-6)


def sim_end(sim):
    return max((v.engine.now_s or 0) for v in sim.vpods.values() if v.engine)


def test_deterministic_for_a_seed(db):
    _, a = run(db, cfg=ClusterConfig(seed=3))
    _, b = run(db, cfg=ClusterConfig(seed=3))
    assert a["decode"].to_json() == b["decode"].to_json()
    assert a["prefill"].to_json() == b["prefill"].to_json()


def test_cold_start_waits_for_vpod_creation(db):
    sim, _ = run(db, cfg=ClusterConfig(warm_start=False))
    warm, _ = run(db)
    # the controller plans after the first 10-s slice; creation (>= 73 s) + engine start (31 s)
    # come before the first token of the first request
    first = int(np.argmin(trace()[0]))
    assert sim.ttft[first] > 73 + 31 - 10
    assert warm.ttft[first] < 5.0
    assert not np.isnan(sim.ttft).any()


def test_quota_forces_failover_to_other_chips(db):
    arr, inp, out = trace(seed=1)
    e = db.entry_at("decode", db.bucket_index(int((inp + out).max())))
    sim, rep = run(db, cfg=ClusterConfig(quotas={e.chip: 0}), tr=(arr, inp, out))
    dec = [v for v in sim.vpods.values() if v.phase == "decode"]
    assert dec and all(v.chip != e.chip for v in dec)
    # every vPod of a group whose best fit is on the forbidden chip is a fail-over
    assert rep["decode"].failovers == sum(v.group.startswith(e.chip + ":") for v in dec) > 0
    assert all(v.failover == v.group.startswith(e.chip + ":") for v in dec)


def test_base_uses_one_allocation_and_ideal_is_an_upper_bound(db):
    tr = trace(n=600, lo=100, hi=8000)
    sim_b, base = run(db, "base", tr=tr)
    assert len({v.group for v in sim_b.vpods.values() if v.phase == "decode"}) == 1
    ideal = ideal_report(ARCH, db, *tr)
    for ph in ("prefill", "decode"):
        assert ideal[ph].to_json()["tokens_per_j"] > base[ph].to_json()["tokens_per_j"]
        assert ideal[ph].to_json()["slo_rate"] == 1.0


def test_pipeline_parallel_vpod_runs_pp_virtual_engines():
    """vLLM runs a PP=8 vPod as 8 staggered virtual engines: 8x the throughput of one engine,
    each request still taking the full pass; static power paid once."""
    from dse import default_catalog
    from dse.costmodel import Parallelism
    from dse.vpod import ICITopology
    from sim.chip import ChipModel
    from sim.cluster import VPodEngines
    from sim.fastengine import PrefillEngine
    from sim.stepcost import PipelineShare, StepCostTable
    chip = default_catalog().get("v6e")
    table = StepCostTable(ChipModel(load_model("llama3-70b"), chip, ICITopology.parse("4x2"),
                                    Parallelism(1, 8)))

    def run(engines):
        v = VPodEngines(engines)
        for i in range(64):
            v.submit(i, 0.0, 1024, 1)
        done = v.advance_to(1e6)
        assert len(done) == 64
        return max(r.finish_s for r in done), v.energy_j(), min(r.ttft_s for r in done)

    t1, e1, ttft1 = run([PrefillEngine(table, max_batch=1)])
    t8, e8, ttft8 = run([PrefillEngine(PipelineShare(table, 8), max_batch=1)
                         for _ in range(8)])
    assert t1 / t8 == pytest.approx(8, rel=0.02)
    assert ttft8 == pytest.approx(ttft1, rel=1e-9)           # a request's own pass is unchanged
    # same work, same horizon (both advanced to t = 1e6 s): the 8 shares pay static power once
    assert e8 == pytest.approx(e1, rel=1e-9)


def test_mispredicted_requests_migrate_past_twice_their_groups_length(db):
    """accuracy 0: every request goes to a random group not shorter than its input and every
    re-estimate is wrong, so a request moves exactly when its length passes 2x its group's
    best-fit length (router.routing.should_migrate), to a longer group, and still finishes."""
    rng = np.random.default_rng(4)
    n = 200
    tr = (np.sort(rng.uniform(0, 300, n)), rng.integers(100, 500, n),
          rng.integers(1000, 6000, n))
    cfg = ClusterConfig(policy=PolicyConfig(coalescing=False), accuracy=0.0, seed=1)
    sim, rep = run(db, cfg=cfg, tr=tr)
    assert rep["decode"].migrations == len(sim.migration_log) > 0
    table = sim._routing["decode"]
    for r, src, dst, length, _ in sim.migration_log:
        assert length > 2 * table.best_len[src] and length - 1 in table.edges
        # ... at the first bucket boundary past 2x (the one before it was not past)
        prev = max(e for e in table.edges if e < length - 1)
        assert prev + 1 <= 2 * table.best_len[src] or prev + 1 <= inp_of(sim, r)
        assert table.best_len[dst] > table.best_len[src]
    assert not np.isnan(sim.tpot).any() and (sim.tpot > 0).all()
    assert rep["decode"].tokens == int((tr[2] - 1).sum())
    # with the right prediction nothing has to move
    _, right = run(db, cfg=ClusterConfig(policy=PolicyConfig(coalescing=False), accuracy=1.0),
                   tr=tr)
    assert right["decode"].migrations == 0


def inp_of(sim, r):
    return int(sim.requests[1][r])


def test_per_minute_snapshots_count_what_finished_in_each_minute(db):
    sim, rep = run(db)
    arr, inp, out = sim.requests
    pre = [m for m in sim.minutes if m["phase"] == "prefill"]
    assert [m["t_s"] for m in pre] == [60.0 * (k + 1) for k in range(len(pre))]
    done_at = arr + sim.ttft
    for m in pre:
        assert m["finished"] == int(((done_at > m["t_s"] - 60) & (done_at <= m["t_s"])).sum())
        assert m["slo_rate"] is None or 0.0 <= m["slo_rate"] <= 1.0
        assert m["energy_j"] >= 0.0
    assert any(m["vpods"] for m in pre)
    # the minutes' energy adds up to the run's, less what the drain after the last minute used
    total = sum(m["energy_j"] for m in pre)
    assert 0.5 * rep["prefill"].energy_j < total <= rep["prefill"].energy_j * (1 + 1e-9)


def test_chip_mixes_restrict_each_phase_to_its_chips(db):
    arr, inp, out = trace()
    cfg = ClusterConfig()
    mix = {"prefill": ("v5e",), "decode": ("v4",)}
    sim = ClusterSim(ARCH, db, make_policies("neuscale", db, cfg.policy, inp, out, mix), cfg)
    rep = sim.run(arr, inp, out)
    chips = {(v.phase, v.chip) for v in sim.vpods.values()}
    assert chips == {("prefill", "v5e"), ("decode", "v4")}
    assert not np.isnan(sim.tpot).any()
    # the SLOs are those of the full database: the older chips meet fewer of them
    _, het = run(db)
    assert rep["prefill"].slo_met <= het["prefill"].slo_met
    with pytest.raises(Exception, match="best-fit database has"):
        make_policies("neuscale", db, cfg.policy, inp, out, {"prefill": ("tpu9",)})


def test_plans_act_after_the_statistics_query_and_unservable_requests_are_dropped(db):
    arr, inp, out = trace(seed=2, span=900.0)
    sim, rep = run(db, cfg=ClusterConfig(warm_start=False), tr=(arr, inp, out))
    # every vPod was ordered at an epoch boundary (or the cold-start plan after the first
    # 10-s slice) and created 2-5 s later (Table 3: query vPod runtime statistics)
    for v in sim.vpods.values():
        lag = min((v.created_s - t) for t in (10.0, *np.arange(300.0, 1300.0, 300.0))
                  if v.created_s >= t)
        assert 2.0 <= lag <= 5.0, (v.id, v.created_s)
    # decode's best chip has no quota and fail-over may use no other chip: decode requests
    # are never served, the run still ends, and they count as dropped SLO misses
    e = db.entry_at("decode", db.bucket_index(int((inp + out).max())))
    cfg = ClusterConfig(policy=PolicyConfig(failover_chips=(e.chip,), coalescing=False),
                        quotas={e.chip: 0})
    sim, rep = run(db, cfg=cfg, tr=(arr, inp, out))
    d = rep["decode"]
    assert d.dropped > 0 and d.slo_met + d.dropped <= d.requests
    assert not any(v.phase == "decode" and v.chip == e.chip for v in sim.vpods.values())
    assert d.tokens == int((out[np.isfinite(sim.tpot)] - 1).sum())


def test_group_changes_make_before_break(db):
    """Half an hour of the real 2023 Azure conversation trace: decode groups change as the
    length mix moves. Routing a bucket to its new group before that group has a ready vPod
    parks requests at the router for the vPod's start-up (minutes): their TPOT blows up."""
    from sim.traces import load_trace
    tr = load_trace("azure-conv-2023", hours=0.5)
    t = (np.asarray(tr.arrival_s), np.asarray(tr.input_tokens), np.asarray(tr.output_tokens))
    _, rep = run(db, tr=t)
    _, brk = run(db, cfg=ClusterConfig(make_before_break=False), tr=t)
    ok, broken = (r["decode"].slo_met / r["decode"].requests for r in (rep, brk))
    assert ok > broken + 0.05 and ok > 0.95
