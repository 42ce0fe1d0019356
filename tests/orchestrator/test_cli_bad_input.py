"""Bad input to the CLI, the way users break it: one line `error: ...` (exit status 2) or the
right number - never a traceback, a silently ignored flag or work done before a doomed write."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dse import load_model
from orchestrator.cluster import ClusterConfig, ClusterSim, ideal_report
from orchestrator.policy import Observation, Policy, PolicyConfig
from orchestrator.registry import make_policies

ROOT = Path(__file__).resolve().parents[2]


def cli(*args, cache=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if cache:
        env["NEUSCALE_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args],
                          capture_output=True, text=True, env=env, timeout=900)


def one_error(p, *needles):
    """Exit status 2, exactly one stderr line, ``error: ...`` holding every needle."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def strict_json(text):
    """JSON as a strict parser (JavaScript's) reads it: no NaN or Infinity."""
    def bad(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=bad)


@pytest.fixture(scope="module")
def db_path(llama8b_db):
    return str(llama8b_db[1])


SIM = ("simulate", "--model", "llama3-8b", "--trace", "azure-conv-2023", "--hours", "0.05",
       "--seed", "1", "--json")


def test_chip_names_resolve_through_the_catalog_everywhere(db_path):
    zero = cli(*SIM, "--db", db_path, "--policy", "neuscale",
               "--quota", "v6e=0,v5p=0,v5e=0,v4=0")
    alias = cli(*SIM, "--db", db_path, "--policy", "neuscale",
                "--quota", "V6E=0,NPU-C=0,tpu-v5e=0,npu-a=0")
    assert zero.returncode == 0 and alias.returncode == 0, alias.stderr
    assert strict_json(zero.stdout)["policies"] == strict_json(alias.stdout)["policies"]
    rep = strict_json(alias.stdout)["policies"]["neuscale"]
    # no chip at all: no vPod, every request dropped (it used to run v6e vPods)
    assert rep["prefill"]["vpod_hours"] == {} and rep["prefill"]["dropped"] == \
        rep["prefill"]["requests"] > 0
    one_error(cli(*SIM, "--db", db_path, "--failover-chips", "h100"), "unknown chip 'h100'")
    one_error(cli(*SIM, "--db", db_path, "--quota", "v6e=8,V6E=0"), "v6e twice")
    mix = cli(*SIM, "--db", db_path, "--policy", "neuscale", "--chip-mix",
              "prefill=NPU-D,decode=npu-c")
    assert mix.returncode == 0, mix.stderr


def test_a_database_for_another_model_or_other_chips_is_refused(db_path, tmp_path):
    one_error(cli("simulate", "--model", "llama3-70b", "--trace", "azure-conv-2023",
                  "--db", db_path), "built for model 'llama3-8b'", "llama3-70b")
    chip = tmp_path / "faster-v6e.json"
    spec = json.loads(Path(db_path).read_text())["catalog"]
    v6e = dict(next(c for c in spec if c["name"] == "v6e"))
    v6e.update(name="tpu-x", aliases=[])
    chip.write_text(json.dumps(v6e))
    # a chip file that only adds a chip leaves the database valid
    ok = cli(*SIM, "--db", db_path, "--policy", "ideal", "--chip-file", str(chip))
    assert ok.returncode == 0, ok.stderr


def test_metric_and_slo_scale_must_agree_with_the_database(db_path):
    one_error(cli(*SIM, "--db", db_path, "--metric", "cost"), "--metric cost contradicts")
    one_error(cli(*SIM, "--db", db_path, "--slo-scale", "3"), "--slo-scale 3 contradicts")
    same = cli(*SIM, "--db", db_path, "--policy", "ideal", "--metric", "energy",
               "--slo-scale", "5")
    assert same.returncode == 0, same.stderr


def test_arguments_that_parse_to_nothing_or_nonsense(db_path, tmp_path):
    one_error(cli(*SIM, "--db", db_path, "--policy", ","), "names no policy")
    one_error(cli(*SIM, "--db", db_path, "--policy", "base,base"), "twice")
    one_error(cli(*SIM, "--db", db_path, "--seed", "-1"), "--seed must be >= 0")
    one_error(cli(*SIM, "--db", db_path, "--accuracy", "2"), "between 0 and 1")
    one_error(cli("simulate", "--model", "llama3-8b"), "required: --trace")
    bad = tmp_path / "latin1.csv"
    bad.write_bytes("model,chip\nllama3-8b,v6e\xe9\n".encode("latin-1"))
    one_error(cli("sim", "step", "--from-csv", str(bad), "--out", str(tmp_path / "o.csv")),
              "not a UTF-8 CSV")


def test_outputs_are_checked_before_the_work(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    cache = tmp_path / "cache"
    for args, needle in [
            (("dse", "build", "--model", "llama3-8b", "--out", str(tmp_path)), "is a directory"),
            (("dse", "build", "--model", "llama3-8b", "--out", str(f / "db.json")),
             "is a file, not a directory"),
            (("dse", "build", "--model", "llama3-8b", "--out", "/proc/db.json"),
             "cannot write in '/proc'"),
            (("dse", "plot", "--db", str(f), "--out", str(f)), "not a directory"),
            (("dse", "validate", "--model", "llama3-8b", "--phase", "decode", "--seq-len", "9",
              "--plot", str(f)), "not a directory"),
            (("simulate", "--model", "llama3-8b", "--trace", "azure-conv-2023", "--out", str(f)),
             "not a directory"),
            (("sim", "step", "--from-csv", str(f), "--out", str(tmp_path)), "is a directory")]:
        one_error(cli(*args, cache=cache), needle)
    # nothing was lowered or built before those errors
    assert not cache.exists() or not any(cache.rglob("*.json"))


def test_verify_and_plot_check_their_destination(db_path, tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    one_error(cli("dse", "verify", "--db", db_path, "--out", str(f / "v.json")), "is a file")
    one_error(cli("dse", "plot", "--db", db_path, "--out", str(f)), "not a directory")


def test_json_output_is_strict(db_path):
    p = cli("dse", "query", "--db", db_path, "--phase", "prefill", "--seq-len", "900000",
            "--chip", "v5e", "--json")
    # v5e fits nothing there: an infeasible answer is an error, not an Infinity in the output
    assert p.returncode == 2 or strict_json(p.stdout)
    text = Path(db_path).read_text()
    assert "Infinity" not in text and "NaN" not in text
    strict_json(text)
    show = cli("dse", "show", "--db", db_path, "--json")
    assert show.returncode == 0
    strict_json(show.stdout)


def test_argparse_errors_are_one_line():
    one_error(cli("dse", "build"), "--model")
    one_error(cli("simulate", "--bogus"), "")
    one_error(cli("nope"), "invalid choice")


def test_workers_are_capped_at_the_cpu_count(capsys):
    from orchestrator.cli.common import workers
    assert workers(1) == 1
    n = os.cpu_count()
    assert workers(n + 14) == n and "exceeds" in capsys.readouterr().err


def test_slo_scale_that_no_allocation_meets_is_said(llama8b_db, capsys):
    import dataclasses

    from dse import BestFitDB
    from orchestrator.cli.dse import warn_if_no_slo_met
    db = llama8b_db[0]
    warn_if_no_slo_met(db)
    assert capsys.readouterr().err == ""
    none = BestFitDB(dict(db.meta), [dataclasses.replace(e, meets_slo=False)
                                     for e in db.entries], db.pareto, db.explain)
    warn_if_no_slo_met(none)
    assert "no allocation meets its SLO" in capsys.readouterr().err


# ---- requests no allocation can hold ---------------------------------------------------------

ARCH = load_model("llama3-8b")


def test_requests_longer_than_the_largest_bucket_are_dropped_on_arrival(llama8b_db):
    db = llama8b_db[0]
    rng = np.random.default_rng(0)
    n = 200
    arr = np.sort(rng.uniform(0, 600, n))
    inp, out = rng.integers(100, 3000, n), rng.integers(2, 200, n)
    huge_in, huge_out = inp.copy(), out.copy()
    huge_in[[10, 50]] = [10 ** 12, 10 ** 7]          # a prompt no bucket holds
    huge_out[120] = 10 ** 15                         # an answer no bucket holds
    cfg = ClusterConfig(seed=1)
    runs = {}
    for name, (i, o) in {"plain": (inp, out), "huge": (huge_in, huge_out)}.items():
        pols = make_policies("neuscale", db, cfg.policy, i, o)
        runs[name] = ClusterSim(ARCH, db, pols, cfg).run(arr, i, o)
    plain, huge = runs["plain"].reports, runs["huge"].reports
    assert huge["prefill"].dropped == 3 and huge["decode"].dropped == 3
    assert np.isnan(runs["huge"].ttft_s[[10, 50, 120]]).all()
    # they drive no scaling: the same vPods as without them, and no tokens of theirs served
    assert huge["prefill"].vpod_hours == pytest.approx(plain["prefill"].vpod_hours, rel=0.05)
    assert huge["decode"].vpod_hours == pytest.approx(plain["decode"].vpod_hours, rel=0.05)
    assert huge["prefill"].tokens < plain["prefill"].tokens + 10 ** 6
    ideal = ideal_report(ARCH, db, arr, huge_in, huge_out)
    assert ideal["prefill"].dropped == 3 and ideal["decode"].dropped == 3
    assert ideal["prefill"].tokens == int(np.delete(huge_in, [10, 50, 120]).sum())
    assert ideal["prefill"].slo_met == n - 3


def test_one_plan_orders_a_bounded_number_of_vpods(llama8b_db):
    db = llama8b_db[0]
    obs = Observation(0.0, {20: np.full(180, 1e15)})
    plan = Policy(db, "decode").plan(obs)
    created = sum(a.count for a in plan.actions if a.kind == "create")
    assert created == PolicyConfig().max_new_vpods
    left = [a for a in plan.actions if a.kind == "unsatisfied"]
    assert left and left[0].count > 10 ** 6 and "new vPods" in left[0].reason
    small = Policy(db, "decode", PolicyConfig(max_new_vpods=3)).plan(obs)
    assert sum(a.count for a in small.actions if a.kind == "create") == 3
    assert math.isfinite(plan.rates[next(iter(plan.rates))])


def test_absolute_timestamps_are_rebased_and_endless_spans_refused(db_path, tmp_path):
    unix = tmp_path / "unix.csv"
    t0 = 1.7e9
    unix.write_text("arrival_s,input_tokens,output_tokens\n" + "".join(
        f"{t0 + 0.5 * i},{200 + i},{20 + i % 7}\n" for i in range(120)))
    p = cli("simulate", "--model", "llama3-8b", "--trace", str(unix), "--db", db_path,
            "--policy", "neuscale", "--json")
    assert p.returncode == 0, p.stderr
    r = strict_json(p.stdout)
    assert r["trace"]["duration_s"] == pytest.approx(59.5) and "rebased" in r["trace_note"]
    assert "absolute time" in p.stderr
    one_error(cli("simulate", "--model", "llama3-8b", "--trace", "azure-conv-2023",
                  "--db", db_path, "--rate-scale", "1e-4", "--policy", "neuscale"),
              "days, more than the 7-day limit")
