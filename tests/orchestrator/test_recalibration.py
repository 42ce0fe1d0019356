"""Online recalibration (issue 14 part 6): measured vs modelled latency per allocation corrects
the load-aware policy. Unit tests on the real chip model and database, and one end-to-end run
of `orchestrator serve --backend sim` whose engines run a slower profile than the database
assumed."""
import json
import math
import sqlite3
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dse import default_catalog, load_model
from orchestrator.calibration import (HIGH, LOW, MIN_REQUESTS, Calibration, Recalibrator,
                                      parse_metrics)
from orchestrator.loadaware import LoadAwarePolicy
from orchestrator.policy import Observation
from orchestrator.pricing import Alloc, CalibratedPricer, ChipModelPricer
from sim.vpod import TableCache

ARCH = load_model("llama3-8b")
KEY = ("v6e", "2x2", 4, 1, 1, "dp", "decode")


def test_factors_smooth_bound_and_default_to_the_phases_mean():
    c = Calibration()
    assert c.factor(KEY) == 1.0 and c.version == 0
    assert c.update(KEY, 0.030, 0.010) == pytest.approx(3.0)      # first measurement: as is
    assert c.update(KEY, 0.010, 0.010) == pytest.approx(math.sqrt(3.0))  # log-space EWMA 1/2
    assert c.update(KEY, 1.0, 0.001) <= HIGH and c.update(KEY, 1e-6, 1.0) >= LOW
    assert c.update(KEY, float("nan"), 1.0) is None and c.update(KEY, 1.0, 0.0) is None
    other = ("v5p", "2x2x1", 4, 1, 1, "dp", "decode")
    c2 = Calibration()
    c2.update(KEY, 0.02, 0.01)
    c2.update(("v5e", "2x4", 8, 1, 1, "dp", "decode"), 0.08, 0.01)
    assert c2.factor(other) == pytest.approx(math.sqrt(2 * 4))   # unobserved: phase's mean
    assert c2.factor(other[:6] + ("prefill",)) == 1.0             # another phase: nothing
    back = Calibration.from_json(json.loads(json.dumps(c2.to_json())))
    assert back.factors == c2.factors
    assert Calibration.from_json([{"chip": "v6e"}, "junk", {"factor": "x"}]).factors == {}
    assert Calibration.from_json({"not": "a list"}).factors == {}


def _metrics(tpot_sum, tpot_n, running, kv_frac, waiting=0):
    return (f'vllm:time_per_output_token_seconds_sum{{model_name="m"}} {tpot_sum}\n'
            f'vllm:time_per_output_token_seconds_count{{model_name="m"}} {tpot_n}\n'
            f'vllm:num_requests_running{{model_name="m"}} {running}\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv_frac}\n')


def test_parse_metrics_sums_label_sets_and_ignores_the_rest():
    m = parse_metrics('# HELP x\nvllm:num_requests_running{a="1"} 3\n'
                      'vllm:num_requests_running{a="2"} 4\nvllm:other 9\nbroken line\n')
    assert m["vllm:num_requests_running"] == 7 and m["vllm:kv_cache_usage_perc"] == 0


def test_decode_factor_is_measured_over_modelled_tpot_at_the_observed_batch():
    tables = TableCache(ARCH, default_catalog(), on_disk=False)
    r = Recalibrator(lambda k: tables(k[:6]))
    t = tables(KEY[:6])
    n, frac = 16, 0.05
    kv = frac * t.kv_capacity_tokens
    model = float(t.step(0.0, 0.0, float(n), kv)[0])
    r.observe("a", KEY, _metrics(0, 0, n, frac))
    r.observe("a", KEY, _metrics(2.5 * model * 40, 40, n, frac))
    moved = r.update()
    assert moved[KEY] == pytest.approx(2.5, rel=1e-6)
    # too few finished requests: the factor stays
    r.observe("a", KEY, _metrics(2.5 * model * 40 + 9 * model * 3, 43, n, frac))
    assert MIN_REQUESTS > 3 and r.update() == {}
    assert r.calibration.factor(KEY) == pytest.approx(2.5)


def test_calibrated_pricer_scales_latency_and_throughput_and_says_when():
    base = ChipModelPricer(ARCH, default_catalog())
    cal = Calibration()
    p = CalibratedPricer(base, cal)
    a = Alloc("v6e", "2x2", 4, 4, 1, 1, 64)
    c0 = p.cost(a, "decode", 2048)
    cal.update(KEY, 0.02, 0.01)
    c1 = p.cost(a, "decode", 2048)
    assert p.version == 1
    assert c1.latency_s == pytest.approx(2 * c0.latency_s)
    assert c1.throughput_tok_per_s == pytest.approx(c0.throughput_tok_per_s / 2)
    assert c1.dyn_j_per_token == c0.dyn_j_per_token


def test_slower_engines_make_the_policy_add_capacity(llama8b_db):
    """The same load planned with the factors the engines measured: more chips (vPods that
    each do less, or faster ones), and every pick meets its SLO at its corrected latency."""
    db = llama8b_db[0]
    i = db.bucket_index(2048)
    best = db.entry_at("decode", i)
    obs = Observation(0.0, {i: np.full(180, 0.8 * best.throughput_tok_per_s)})
    cal = Calibration()
    pricer = CalibratedPricer(ChipModelPricer(ARCH, default_catalog(), db.stack), cal)
    pol = LoadAwarePolicy(db, "decode", pricer=pricer)

    def chips(plan):
        return sum(n * plan.groups[g].entry.num_chips for g, n in plan.target.items())
    p0 = pol.plan(obs)
    for chip in db.chips:                          # every decode allocation measured 2x slower
        for p in db.pareto_for("decode", db.edges[i], chip):
            cal.update((chip, p["topology"], p["tp"], p["pp"], p["ep"], p.get("attn", "dp"),
                        "decode"), 0.02, 0.01)
    plan = pol.plan(obs)                           # the policy sees the new version
    # twice the chips (llama3-8b: 3 v5p-4 TP 4 vPods become 3 v5p-8 TP 8 ones, whose
    # corrected TPOT still meets the SLO at their batch)
    assert chips(plan) >= 1.5 * chips(p0)
    for g, n in plan.target.items():
        if not n:
            continue
        e = plan.groups[g].entry
        lat = pricer.cost(Alloc(e.chip, e.topology, e.num_chips, e.tp, e.pp, e.ep, e.max_batch,
                                e.attn), "decode", db.edges[i]).latency_s
        assert lat <= db.meta["slo_s"]["decode"][i] * (1 + 1e-9)


# ---- end to end ----------------------------------------------------------------------------------

SLOW = json.dumps({"name": "slow-per-sequence", "step_s": 0.0055, "per_seq_s": 0.0015,
                   "request_s": 0.045, "attn_decode_eff": 0.96, "overlap": False})


def test_serve_recalibrates_when_the_engines_run_slower_than_the_database(tmp_path):
    """Engines with 1.5 ms of host time per sequence per step (the database assumed none):
    24 clients make the first decode vPod's TPOT several times the model's. The controller
    measures it, the factor appears in `orchestrator status`, the policy moves decode to
    more vPods of a smaller batch, and requests served there decode faster than on the
    first group (the served-request log says which group served each request)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from openai import AsyncOpenAI
    from test_serve_e2e import Serve
    import asyncio
    s = Serve(tmp_path, "--engine-stack", SLOW)
    try:
        first = {g["group"] for g in s.status()["groups"] if g["phase"] == "decode"}
        peak = [0]

        async def client(stop):
            c = AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=2, timeout=120)
            while time.time() < stop:
                st = await c.completions.create(model="llama3-8b", prompt="hello " * 100,
                                                max_tokens=120, stream=True)
                async for _ in st:
                    pass

        async def watch(stop):
            while time.time() < stop:
                await asyncio.sleep(1.0)
                st = await asyncio.to_thread(s.status)
                peak[0] = max(peak[0], sum(v["phase"] == "decode" for v in st["vpods"]))

        async def main():
            stop = time.time() + 35
            await asyncio.gather(watch(stop), *(client(stop) for _ in range(24)))
        asyncio.run(main())
        st = s.status()
        cal = [c for c in st["calibration"] or [] if c["phase"] == "decode"]
        assert cal and max(c["factor"] for c in cal) >= 1.5, cal
        assert any(a["kind"] == "recalibrate" for a in st["recent_actions"])
        assert peak[0] >= 3                      # from the one bootstrap vPod
    finally:
        s.stop()
    rows = sqlite3.connect(s.state).execute(
        "SELECT decode_group, tpot_s FROM requests WHERE tpot_s IS NOT NULL").fetchall()
    on_first = [t for g, t in rows if g in first]
    later = [t for g, t in rows if g not in first]
    assert len(on_first) >= 10 and len(later) >= 10, (len(on_first), len(later))
    assert np.mean(later) < 0.8 * np.mean(on_first)
    # restarts keep the factors: they are in the state
    saved = sqlite3.connect(s.state).execute(
        "SELECT value FROM kv WHERE key = 'calibration'").fetchone()
    assert saved and json.loads(saved[0])
