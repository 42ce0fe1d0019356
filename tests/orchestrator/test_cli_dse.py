"""The `orchestrator dse ...` commands, run as a user runs them (a subprocess)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args, check=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True,
                       text=True, env=env, timeout=600)
    if check is not None:
        assert p.returncode == check, p.stderr
    return p


def one_error_line(p, pattern):
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in p.stderr
    assert pattern in lines[-1], p.stderr
    return lines[-1]


def test_help_explains_every_command():
    out = run("dse", "--help", check=0).stdout
    for cmd in ("build", "query", "cost", "show", "plot"):
        assert cmd in out
    assert "--slo-scale" in run("dse", "build", "--help", check=0).stdout


def test_build_query_show_plot(tmp_path):
    db = tmp_path / "db.json"
    p = run("dse", "build", "--model", "llama3-8b", "--chips", "v5e,v6e", "--metric", "cost",
            "--out", str(db), "--json", check=0)
    info = json.loads(p.stdout)
    assert info["entries"] == 48 * 2 * 2 and Path(info["db"]) == db
    q = json.loads(run("dse", "query", "--db", str(db), "--phase", "prefill", "--seq-len",
                       "3000", "--json", "--explain", check=0).stdout)
    e = q["entry"]
    for k in ("chip", "topology", "num_chips", "tp", "pp", "ep", "max_batch", "latency_s",
              "throughput_tok_per_s", "energy_j_per_token", "usd_per_token", "slo_s",
              "meets_slo"):
        assert k in e
    assert e["seq_len"] == 3072 and e["chip"] in ("v5e", "v6e")
    assert q["explain"]["candidates"] >= q["explain"]["feasible"] > 0
    assert q["pareto"] and all(a["latency_s"] < b["latency_s"] and
                               a["efficiency"] < b["efficiency"]
                               for a, b in zip(q["pareto"], q["pareto"][1:]))
    txt = run("dse", "query", "--db", str(db), "--phase", "decode", "--seq-len", "100",
              "--chip", "v5e", "--explain", check=0).stdout
    assert "v5e:" in txt and "Pareto front" in txt
    show = run("dse", "show", "--db", str(db), check=0).stdout
    assert show.count("\nprefill") == 48 and show.count("\ndecode") == 48
    plots = json.loads(run("dse", "plot", "--db", str(db), "--out", str(tmp_path / "p"),
                           "--json", check=0).stdout)["plots"]
    assert len(plots) >= 3
    for f in plots:
        assert Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cost_json_keys_and_values():
    p = run("dse", "cost", "--model", "llama3-70b", "--chip", "v5p", "--tp", "4",
            "--phase", "decode", "--batch", "8", "--seq-len", "2048", "--json", check=0)
    c = json.loads(p.stdout)
    for k in ("flops", "hbm_bytes", "ici_bytes", "flops_source", "latency_s", "energy_j",
              "cost_usd", "bound"):
        assert k in c
    assert c["vpod"] == "v5p:2x2x1" and c["accelerator_type"] == "v5p-8"
    assert c["flops"] > 2 * 8 * 70e9 / 4 * 0.9 and c["ici_bytes"] > 0
    assert c["bound"] == "memory" and c["feasible"]
    assert c["cost_usd"] == pytest.approx(4 * 4.20 / 3600 * c["latency_s"], rel=1e-9)
    p = run("dse", "cost", "--model", "llama3-70b", "--chip", "v5e", "--tp", "1",
            "--phase", "decode", "--batch", "1", "--seq-len", "128", check=0)
    assert "does NOT fit" in p.stdout and "weights" in p.stdout


@pytest.mark.parametrize("args,msg", [
    (("dse", "build", "--model", "gpt-9"), "unknown model 'gpt-9'"),
    (("dse", "build", "--model", "llama3-8b", "--chips", "v9"), "unknown chip 'v9'"),
    (("dse", "cost", "--model", "llama3-8b", "--chip", "tpu9", "--tp", "1", "--phase",
      "decode", "--batch", "1", "--seq-len", "8"), "unknown chip 'tpu9'"),
    (("dse", "cost", "--model", "llama3-8b", "--chip", "v6e", "--tp", "1", "--phase",
      "decode", "--batch", "1", "--seq-len", "2000000"), "exceeds the largest bucket"),
    (("dse", "cost", "--model", "llama3-8b", "--chip", "v6e", "--tp", "3", "--phase",
      "decode", "--batch", "1", "--seq-len", "8"), "must be a power of two"),
    (("dse", "cost", "--model", "llama3-8b", "--chip", "v6e", "--tp", "2", "--topology",
      "4x4", "--phase", "decode", "--batch", "1", "--seq-len", "8"), "uses 2 chips"),
    (("dse", "query", "--db", "/nonexistent.json", "--phase", "decode", "--seq-len", "5"),
     "no best-fit database"),
])
def test_user_errors_are_one_clear_line(args, msg):
    one_error_line(run(*args), msg)


def test_bad_seq_len_is_rejected_by_the_parser():
    p = run("dse", "query", "--db", "x.json", "--phase", "decode", "--seq-len", "0")
    assert p.returncode == 2 and "--seq-len must be >= 1" in p.stderr
    p = run("dse", "query", "--db", "x.json", "--phase", "decode", "--seq-len", "ten")
    assert p.returncode == 2 and "must be an integer" in p.stderr


def test_infeasible_model_is_one_clear_line(tmp_path):
    cfg = json.loads((ROOT / "dse" / "presets" / "llama3.1-405b.json").read_text())
    cfg.update(hidden_size=65536, intermediate_size=262144, num_hidden_layers=128,
               num_attention_heads=512, num_key_value_heads=8)   # ~7 T parameters
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    line = one_error_line(run("dse", "build", "--model", str(f), "--chips", "v5e"),
                          "does not fit")
    assert "v5e" in line
