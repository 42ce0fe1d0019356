"""Roofline vs chip model (paper Figs. 9-11) on real candidates."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dse import load_model
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
