"""Roofline vs chip model (paper Figs. 9-11) on real candidates."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dse import BestFitDB, load_model
from sim.validate import Validator, pearson, ranks, spearman

ROOT = Path(__file__).resolve().parents[2]


def test_rank_statistics():
    assert list(ranks([10, 30, 20, 20])) == [0, 3, 1.5, 1.5]
    x = np.arange(50.0)
    assert spearman(x, x ** 3) == pytest.approx(1.0)
    assert pearson(x, x ** 3) < 0.95
    assert spearman(x, -x) == pytest.approx(-1.0)


@pytest.fixture(scope="module")
def v8():
    return Validator(load_model("llama3-8b"), chips=["v5e", "v6e"])


@pytest.mark.parametrize("phase,seq", [("prefill", 4096), ("decode", 4608)])
def test_roofline_ranks_allocations_like_the_chip_model(v8, phase, seq):
    v = v8.validate(phase, seq, max_candidates=400)
    assert len(v.points) == 400 and v.candidates_total > 400
    assert v.spearman_latency > 0.95 and v.spearman_eff > 0.95
    # the chip model is never faster than the roofline bound on the same allocation
    assert all(p.sim_latency_s >= p.pred_latency_s * 0.999 for p in v.points)
    # the sample holds the whole predicted front, and coverage is what the fronts say
    lat = np.array([p.pred_latency_s for p in v.points])
    assert v.predicted_front and v.true_front
    cov = len(set(v.true_front) & set(v.predicted_front)) / len(v.true_front)
    assert v.front_coverage == cov and cov >= 0.5
    assert lat[v.predicted_front].min() == lat.min()


def test_allocation_accuracy_two_buckets(v8):
    rows = v8.allocation_accuracy("decode", [1024, 8192], max_candidates=200)
    assert [r["seq_len"] for r in rows] == [1024, 8192]
    for r in rows:
        assert 0 < r["ratio"] <= 1.0 + 1e-9 or not r["predicted_meets_sim_slo"]
        assert r["slo_sim_s"] >= r["slo_roofline_s"]     # the chip model is slower


def test_validate_cli_json_and_plots(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "dse", "validate", "--model",
                        "llama3-8b", "--chips", "v6e", "--phase", "prefill", "--seq-len", "4096",
                        "--max-candidates", "200", "--json", "--plot", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["latency"]["spearman_rho"] > 0.9 and 0 <= out["pareto"]["coverage"] <= 1
    assert len(out["plots"]) == 2 and all(Path(f).stat().st_size > 1000 for f in out["plots"])


def test_verified_db_meets_slo_on_the_chip_model(llama8b_db, tmp_path):
    from dse.costmodel import Parallelism
    from dse.vpod import ICITopology
    from sim.chip import ChipModel
    from sim.validate import verify_db
    from dse import default_catalog
    db, path = llama8b_db
    arch = load_model("llama3-8b")
    v = verify_db(db, arch)
    assert v.meta["verified"] == "chip-model" and len(v.entries) == len(db.entries)
    cat = default_catalog()
    for e in v.entries[::23]:
        if not e.feasible:
            continue
        c = cat.get(e.chip)
        r = ChipModel(arch, c, ICITopology.parse(e.topology).for_chip(c),
                      Parallelism(e.tp, e.pp, e.ep)).step(e.phase, e.max_batch, e.seq_len)
        assert e.latency_s == pytest.approx(r.latency_s)          # chip-model numbers
        assert e.meets_slo == (r.latency_s <= e.slo_s)
        # the pick is on the roofline's Pareto front
        assert any(p["topology"] == e.topology and p["batch"] == e.max_batch
                   for p in db.pareto_for(e.phase, e.seq_len, e.chip))
    # at least as many best fits meet the SLO on the chip model as before verification
    def on_chip(e):
        c = cat.get(e.chip)
        return ChipModel(arch, c, ICITopology.parse(e.topology).for_chip(c),
                         Parallelism(e.tp, e.pp, e.ep)).step(e.phase, e.max_batch,
                                                             e.seq_len).latency_s <= e.slo_s
    before = sum(on_chip(e) for e in db.entries if e.feasible)
    after = sum(e.meets_slo for e in v.entries if e.feasible)
    assert after >= before
    # every Pareto point (what a load-aware policy may pick) carries its chip-model check
    n = 0
    for key in list(v.pareto)[::17]:
        phase, edge, chip = key.split("|")
        c = cat.get(chip)
        slo = v.meta["slo_s"][phase][v.bucket_index(int(edge))]
        for p in v.pareto_for(phase, int(edge), chip):
            r = ChipModel(arch, c, ICITopology.parse(p["topology"]).for_chip(c),
                          Parallelism(p["tp"], p["pp"], p["ep"])).step(phase, p["batch"],
                                                                      int(edge))
            assert p["cm_latency_s"] == pytest.approx(r.latency_s)
            assert p["cm_meets_slo"] == (r.latency_s <= slo)
            n += 1
    assert n > 0
    # verifying twice replaces the columns instead of adding them again
    assert verify_db(v, arch).meta["pareto_columns"] == v.meta["pareto_columns"]
    out = tmp_path / "v.json"
    v.save(out)
    assert BestFitDB.load(out).lookup("decode", 3000) == v.lookup("decode", 3000)
    assert BestFitDB.load(out).pareto == v.pareto
