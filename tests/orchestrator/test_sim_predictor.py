"""The cluster simulator replaying a real predictor's measured confusion matrix
(`orchestrator simulate --predictor MODEL_DIR`) instead of the --accuracy coin flip."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dse import load_model
from dse.buckets import SEQ_BUCKETS
from orchestrator.cluster import ClusterConfig, ClusterSim, Confusion
from orchestrator.policy import PolicyConfig
from orchestrator.registry import make_policies
from predictor.head import Head
from predictor.model import LengthModel

ARCH = load_model("llama3-8b")
ROOT = Path(__file__).resolve().parents[2]
K = len(SEQ_BUCKETS)


def test_identity_rows_draw_the_true_bucket_and_borrowed_rows_shift():
    counts = np.zeros((K, K))
    counts[2, 2] = 5                  # answers of bucket 2 always predicted right
    counts[5, 4] = 3                  # bucket 5: one bucket short, or right
    counts[5, 5] = 1
    c = Confusion.from_counts(SEQ_BUCKETS, counts)
    u = np.random.default_rng(0).random(200)
    lens = [c.draw(300, x) for x in u]                      # bucket 2: (256, 384]
    assert all(256 < x <= 384 for x in lens)
    b6 = {min(np.searchsorted(SEQ_BUCKETS, c.draw(800, x)), K - 1) for x in u}
    assert b6 == {5, 6}                # bucket 6 borrows bucket 5's row, one bucket up
    assert {min(np.searchsorted(SEQ_BUCKETS, c.draw(700, x)), K - 1) for x in u} == {4, 5}
    # conditioned on having generated 650: only buckets ending above it remain
    got = {c.draw(700, x, above=650) for x in u}
    assert all(g > 650 for g in got)
    assert c.draw(300, 0.5, above=400) is None              # nothing left: says nothing
    with pytest.raises(ValueError):
        Confusion.from_counts(SEQ_BUCKETS, np.zeros((K, K)))


def _trace(seed=4, n=200):
    rng = np.random.default_rng(seed)
    return (np.sort(rng.uniform(0, 300, n)), rng.integers(100, 500, n),
            rng.integers(1000, 6000, n))


def _run(db, cfg, tr):
    arr, inp, out = tr
    sim = ClusterSim(ARCH, db, make_policies("neuscale-paper", db, cfg.policy, inp, out), cfg)
    return sim.run(arr, inp, out)


def test_a_predictor_that_says_short_makes_requests_migrate(llama8b_db):
    db = llama8b_db[0]
    tr = _trace()
    pc = PolicyConfig(coalescing=False)
    right = _run(db, ClusterConfig(policy=pc, seed=1,
                                   confusion=Confusion.from_counts(SEQ_BUCKETS, np.eye(K))), tr)
    short = np.zeros((K, K))
    short[:, 0] = 1                                          # every answer predicted <= 128
    wrong = _run(db, ClusterConfig(policy=pc, seed=1,
                                   confusion=Confusion.from_counts(SEQ_BUCKETS, short)), tr)
    assert wrong.reports["decode"].migrations > right.reports["decode"].migrations
    assert wrong.reports["decode"].tokens == right.reports["decode"].tokens == \
        int((tr[2] - 1).sum())
    # the default mode is untouched by the new field
    a = _run(db, ClusterConfig(policy=pc, seed=1, accuracy=0.6), tr)
    b = _run(db, ClusterConfig(policy=pc, seed=1, accuracy=0.6, confusion=None), tr)
    assert np.array_equal(a.tpot_s, b.tpot_s)


def _model_dir(tmp_path, counts=None):
    rng = np.random.default_rng(0)
    d = 384 + 2 + 8
    head = Head(rng.standard_normal((d, 4)).astype(np.float32), np.zeros(4, np.float32),
                rng.standard_normal((4, K)).astype(np.float32), np.zeros(K, np.float32),
                np.zeros(d, np.float32), np.ones(d, np.float32))
    m = LengthModel(head=head, edges=SEQ_BUCKETS, encoder_name="bert:x", max_tokens=256)
    nz = [] if counts is None else [[i, j, c] for i, j, c in counts]
    m.manifest = {"eval": {"confusion": {"nonzero": nz}}}
    return m.save(tmp_path / "m")


def sim_cli(*args):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "simulate", "--model",
                           "llama3-8b", "--trace", "azure-code", "--hours", "0.05", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_cli_names_the_prediction_mode_and_refuses_bad_input(tmp_path, llama8b_db):
    db = str(llama8b_db[1])
    good = _model_dir(tmp_path, [(0, 0, 10), (1, 0, 3), (1, 1, 7)])
    r = sim_cli("--db", db, "--predictor", str(good), "--policy", "neuscale", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prediction"].startswith(f"predictor {good} (held-out bucket "
                                                         "accuracy 85.0% on 20 answers)")
    r = sim_cli("--db", db, "--policy", "neuscale", "--json")
    assert json.loads(r.stdout)["prediction"] == "accuracy 0.6"
    for args, msg in [(("--predictor", str(tmp_path / "none")), "no predictor model"),
                      (("--predictor", str(good), "--accuracy", "0.5"), "drop --accuracy"),
                      (("--predictor", str(_model_dir(tmp_path / "e"))), "no held-out")]:
        r = sim_cli("--db", db, *args)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], r.stderr
