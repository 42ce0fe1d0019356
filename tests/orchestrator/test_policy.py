"""Every autoscaling rule of §3.4 on the real llama3-8b best-fit database."""
import dataclasses
import math

import numpy as np
import pytest

from dse import BestFitDB
from orchestrator.policy import Observation, Policy, PolicyConfig, PolicyState, VPodRecord

N = 180   # 30 min of 10-s samples


def rates(**by_bucket):
    return {int(k[1:]): np.asarray(v, dtype=float) for k, v in by_bucket.items()}


def flat(x, n=N):
    return np.full(n, float(x))


@pytest.fixture(scope="module")
def db(llama8b_db):
    return llama8b_db[0]


def spec(db, phase, i):
    e = db.entry_at(phase, i)
    return e, f"{e.chip}:{e.topology}/tp{e.tp}pp{e.pp}ep{e.ep}/b{e.max_batch}"


def vpods(gid, e, n, start=0, **kw):
    return [VPodRecord(f"{gid}#{start + k}", gid, e.chip, e.topology, e.num_chips,
                 throughput_tok_per_s=e.throughput_tok_per_s, max_batch=e.max_batch, **kw)
            for k in range(n)]


def creates(plan, g=None):
    return sum(a.count for a in plan.actions if a.kind == "create" and (g is None or a.group == g))


def deletes(plan, g=None):
    return sum(1 for a in plan.actions if a.kind == "delete" and (g is None or a.group == g))


def test_new_group_sized_by_peak_over_throughput(db):
    e, g = spec(db, "decode", 20)
    T = e.throughput_tok_per_s
    r = np.concatenate([flat(0.5 * T, N - 10), flat(2.5 * T, 10)])   # the peak decides
    p = Policy(db, "decode").plan(Observation(0.0, {20: r}))
    assert p.target[g] == 3 and creates(p, g) == 3
    assert any(a.kind == "create_group" and a.group == g for a in p.actions)
    assert p.routing.group_for_length(db.edges[20]) == g


def test_scale_out_at_most_doubles_per_epoch_unless_emergency(db):
    e, g = spec(db, "decode", 20)
    T = e.throughput_tok_per_s
    obs = Observation(0.0, {20: flat(9.5 * T)}, vpods(g, e, 2))
    p = Policy(db, "decode").plan(obs)
    assert p.target[g] == 4 and creates(p, g) == 2
    assert "capped" in next(a.reason for a in p.actions if a.kind == "create")
    obs.group_peak_queue = {g: 2 * e.max_batch + 5 * e.max_batch}
    p = Policy(db, "decode").plan(obs)
    assert p.target[g] == 7 and "emergency" in p.actions[-1].reason
    off = Policy(db, "decode", PolicyConfig(emergency=False)).plan(obs)
    assert off.target[g] == 4
    # a huge queue grows the group at most x4 per epoch (the bound is configurable)
    obs.group_peak_queue = {g: 1000 * e.max_batch}
    assert Policy(db, "decode").plan(obs).target[g] == 8
    assert Policy(db, "decode", PolicyConfig(emergency_max_factor=10)).plan(obs).target[g] == 20
    # vPods already starting count as slots: they are not ordered again
    obs.bucket_token_rates = {20: flat(4.5 * T)}
    obs.group_peak_queue = {g: 6 * e.max_batch}
    obs.inventory = vpods(g, e, 2) + vpods(g, e, 3, start=2, state="starting")
    assert Policy(db, "decode").plan(obs).target[g] == 6      # not 2 + 4


def test_scale_in_halves_at_most_every_30_minutes_and_follows_the_ewma(db):
    e, g = spec(db, "decode", 20)
    T = e.throughput_tok_per_s
    pol = Policy(db, "decode")
    # a burst 20 minutes ago still fills the 30-min window, but the last epoch is quiet
    r = np.concatenate([flat(8 * T, 60), flat(0.2 * T, 120)])
    st = PolicyState()
    p = pol.plan(Observation(0.0, {20: r}, vpods(g, e, 8)), st)
    assert p.target[g] == 4 and deletes(p, g) == 4          # R says 1, halving allows 4
    p2 = pol.plan(Observation(300.0, {20: r}, vpods(g, e, 4)), p.state)
    assert p2.target[g] == 4 and deletes(p2, g) == 0        # within 30 min of the last halving
    p3 = pol.plan(Observation(1800.0, {20: r}, vpods(g, e, 4)), p2.state)
    assert p3.target[g] == 2
    # EWMA: the scale-in signal mixes the newest epoch peak with the previous signal
    assert p.state.groups[g].ewma_peak == pytest.approx(0.2 * T)
    p4 = pol.plan(Observation(3600.0, {20: flat(2 * T)}, vpods(g, e, 2)), p3.state)
    assert p4.state.groups[g].ewma_peak == pytest.approx(0.5 * 2 * T + 0.5 * 0.2 * T)


def test_group_without_traffic_is_evicted(db):
    e, g = spec(db, "decode", 20)
    p = Policy(db, "decode").plan(Observation(0.0, {}, vpods(g, e, 3)))
    assert deletes(p, g) == 3 and any(a.kind == "evict_group" for a in p.actions)


def group_changes(db, ph):
    """Buckets i whose best fit differs from bucket i + 1's."""
    return [i for i in range(47) if spec(db, ph, i)[1] != spec(db, ph, i + 1)[1]]


def test_coalescing_merges_small_group_into_next_longer_with_room(db):
    # two buckets with different best fits; the short one barely used
    ph = "decode"
    i = group_changes(db, ph)[0]
    (e_small, g_small), (e_big, g_big) = spec(db, ph, i), spec(db, ph, i + 1)
    T_big = e_big.throughput_tok_per_s
    small = 0.1 * e_small.throughput_tok_per_s
    big = 2.5 * T_big                           # 3 vPods, 0.5 of one spare
    assert 0.5 * T_big >= small
    p = Policy(db, ph).plan(Observation(0.0, {i: flat(small), i + 1: flat(big)}))
    assert any(a.kind == "merge_group" and a.group == g_small for a in p.actions)
    assert p.routing.group_for_length(db.edges[i]) == g_big and g_small not in p.target
    p = Policy(db, ph, PolicyConfig(coalescing=False)).plan(
        Observation(0.0, {i: flat(small), i + 1: flat(big)}))
    assert p.routing.group_for_length(db.edges[i]) == g_small
    # no room in the target (it would need another vPod): no merge
    p = Policy(db, ph).plan(Observation(0.0, {i: flat(small), i + 1: flat(2.99 * T_big)}))
    assert not any(a.kind == "merge_group" for a in p.actions)


def test_failover_replacement_and_eviction_under_quota(db):
    e, g = spec(db, "decode", 30)                 # best fit on v5p
    T = e.throughput_tok_per_s
    pol = Policy(db, "decode")
    obs = Observation(0.0, {30: flat(1.5 * T)}, available_chips={e.chip: 0})
    p = pol.plan(obs)
    fo = [a for a in p.actions if a.kind == "create" and a.failover]
    assert len(fo) == 2 and all(a.chip != e.chip for a in fo)
    # ranked: the most efficient SLO-compliant other chip for that bucket
    others = [db.entry_at("decode", 30, c) for c in db.chips if c != e.chip]
    best_other = max((o for o in others if o.feasible),
                     key=lambda o: (o.meets_slo, o.efficiency))
    assert fo[0].chip == best_other.chip
    # forbid fail-over chips: nothing can be had
    none = Policy(db, "decode", PolicyConfig(failover_chips=(e.chip,))).plan(obs)
    assert any(a.kind == "unsatisfied" for a in none.actions)
    # quota is back: fail-over vPods are replaced by best-fit ones
    inv = vpods(g, best_other, 2, failover=True)
    inv = [dataclasses.replace(v, chip=best_other.chip, topology=best_other.topology) for v in inv]
    p = pol.plan(Observation(300.0, {30: flat(1.5 * T)}, inv,
                             available_chips={e.chip: 10 * e.num_chips}))
    assert sum(a.kind == "replace" for a in p.actions) == 2
    # eviction: no quota anywhere; a lower-traffic group on the same chip gives up a vPod
    j = next(k for k in range(48) if spec(db, "decode", k)[0].chip == e.chip and
             spec(db, "decode", k)[1] != g)
    e2, g2 = spec(db, "decode", j)
    quota = {c: 0 for c in db.chips}
    no_merge = Policy(db, "decode", PolicyConfig(coalescing=False))
    p = no_merge.plan(Observation(0.0, {30: flat(1.5 * T), j: flat(0.3 * T)},
                                  vpods(g2, e2, 1) + vpods(g, e, 1), available_chips=quota))
    ev = [a for a in p.actions if a.kind == "delete" and a.group == g2]
    assert ev and "evicted for" in ev[0].reason


def test_unseen_length_uses_nearest_bucket_and_requests_dse(db):
    entries = [dataclasses.replace(x, feasible=False) if x.phase == "decode" and x.seq_len ==
               db.edges[10] else x for x in db.entries]
    hole = BestFitDB(dict(db.meta), entries, db.pareto, db.explain)
    p = Policy(hole, "decode").plan(Observation(0.0, {10: flat(1000.0)}))
    assert any(a.kind == "dse" and str(db.edges[10]) in a.reason for a in p.actions)
    near = {spec(db, "decode", 9)[1], spec(db, "decode", 11)[1]}
    assert p.routing.group_for_length(db.edges[10]) in near


def test_prefill_and_decode_are_independent(db):
    obs = Observation(0.0, {5: flat(5e4)})
    pp = Policy(db, "prefill").plan(obs)
    pd = Policy(db, "decode").plan(obs)
    assert set(pp.target) != set(pd.target) or pp.target != pd.target
    assert all("prefill" not in g for g in pp.target)


def test_plan_explains_itself(db):
    e, g = spec(db, "decode", 20)
    p = Policy(db, "decode").plan(Observation(0.0, {20: flat(3 * e.throughput_tok_per_s)}))
    lines = p.explain()
    assert lines and all(a.reason for a in p.actions)
    assert p.to_json()["target"][g] == math.ceil(3.0)


def test_config_validation():
    with pytest.raises(Exception, match="ewma_alpha"):
        PolicyConfig(ewma_alpha=0)


def test_multipool_splits_buckets_by_percentile(db):
    from orchestrator.baselines import MultiPoolPolicy
    lens = np.concatenate([np.full(50, 300), np.full(50, 6000)])
    pol = MultiPoolPolicy(db, "decode", lens, 2)
    short, long_ = pol.pool_of[db.bucket_index(300)], pol.pool_of[db.bucket_index(6000)]
    assert short.id.startswith("pool1:") and long_.id.startswith("pool2:")
    assert short.best_len >= 300 and long_.best_len >= 6000
    p = pol.plan(Observation(0.0, {db.bucket_index(300): flat(100.0),
                                   db.bucket_index(6000): flat(100.0)}))
    assert set(p.target) == {short.id, long_.id}       # no coalescing between pools
    one = MultiPoolPolicy(db, "decode", lens, 1)
    assert len({s.id for s in one.pool_of.values()}) == 1


def test_coalescing_keeps_the_slo_of_the_merged_buckets(db):
    ph = "decode"
    i = group_changes(db, ph)[0]
    (e_small, g_small), (e_big, g_big) = spec(db, ph, i), spec(db, ph, i + 1)
    slo_small = db.meta["slo_s"][ph][i]
    # the longer group's allocation is too slow for the short bucket's SLO
    slow = [dataclasses.replace(x, latency_s=1.01 * slo_small)
            if x.phase == ph and x.seq_len == db.edges[i + 1] else x for x in db.entries]
    sdb = BestFitDB(dict(db.meta), slow, db.pareto, db.explain)
    obs = Observation(0.0, {i: flat(0.1 * e_small.throughput_tok_per_s),
                            i + 1: flat(2.5 * e_big.throughput_tok_per_s)})
    p = Policy(sdb, ph).plan(obs)
    assert not any(a.kind == "merge_group" for a in p.actions)
    assert p.routing.group_for_length(db.edges[i]) == g_small
    # the paper's rule alone (room, N_L) merges it
    p = Policy(sdb, ph, PolicyConfig(coalesce_keep_slo=False)).plan(obs)
    assert p.routing.group_for_length(db.edges[i]) == g_big


def test_coalescing_skips_a_longer_group_too_slow_for_the_slo(db):
    ph = "decode"
    idx = group_changes(db, ph)
    i, j, k = idx[0], idx[0] + 1, idx[1] + 1             # three buckets, three groups
    (e_s, g_s), (e_m, g_m), (e_l, g_l) = spec(db, ph, i), spec(db, ph, j), spec(db, ph, k)
    assert len({g_s, g_m, g_l}) == 3
    slo_s = db.meta["slo_s"][ph][i]
    slow = [dataclasses.replace(x, latency_s=1.01 * slo_s) if x.phase == ph and
            x.seq_len == db.edges[j] else
            dataclasses.replace(x, latency_s=0.5 * slo_s) if x.phase == ph and
            x.seq_len == db.edges[k] else x for x in db.entries]
    sdb = BestFitDB(dict(db.meta), slow, db.pareto, db.explain)
    obs = Observation(0.0, {i: flat(0.1 * e_s.throughput_tok_per_s),
                            j: flat(2.5 * e_m.throughput_tok_per_s),
                            k: flat(2.5 * e_l.throughput_tok_per_s)})
    p = Policy(sdb, ph).plan(obs)
    assert p.routing.group_for_length(db.edges[i]) == g_l     # past the too-slow middle one
    p = Policy(sdb, ph, PolicyConfig(coalesce_keep_slo=False)).plan(obs)
    assert p.routing.group_for_length(db.edges[i]) == g_m     # the paper's next-longer rule
