"""`orchestrator sim step` as a user runs it."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from dse.stacks import get_stack

ROOT = Path(__file__).resolve().parents[2]


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "sim", "step", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_step_json_with_operator_breakdown():
    p = run("--model", "llama3-70b", "--chip", "v5p", "--num-chips", "8", "--topology", "2x2x2",
            "--tp", "8", "--phase", "decode", "--batch", "64", "--seq-len", "4096", "--json",
            "--ops", "--stack", "jetstream")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["vpod"] == "v5p:2x2x2" and r["fits"]
    assert r["latency_s"] > 0 and r["energy_j"] > 0 and r["bound"] in ("SA", "VU", "HBM", "ICI")
    names = {o["name"] for o in r["ops"]}
    assert {"qkv_proj", "attn_decode_scores", "attn_allreduce", "down_proj", "lm_head"} <= names
    assert all(o["unit"] in ("SA", "VU", "HBM", "ICI") for o in r["ops"])
    total = sum(o["time_s"] * o["count"] for o in r["ops"])
    host = get_stack("jetstream").step_s
    assert abs(total + host - r["latency_s"]) < 1e-9        # ops + jetstream's host time


def test_step_text_and_errors():
    p = run("--model", "llama3-8b", "--chip", "v6e", "--tp", "1", "--phase", "prefill",
            "--batch", "2", "--seq-len", "1024", "--ops")
    assert p.returncode == 0 and "TTFT" in p.stdout and "qkv_proj" in p.stdout
    p = run("--model", "llama3-8b", "--chip", "v6e", "--tp", "1")
    assert p.returncode == 2 and "needs --phase, --batch, --seq-len" in p.stderr
    p = run("--model", "llama3-8b", "--chip", "v6e", "--num-chips", "4", "--tp", "1", "--phase",
            "decode", "--batch", "1", "--seq-len", "10")
    assert p.returncode == 2 and "does not equal tp*pp*ep" in p.stderr


def test_csv_what_ifs_with_an_error_row(tmp_path):
    src = tmp_path / "in.csv"
    src.write_text("model,chip,num_chips,tp,pp,ep,phase,batch,seq_len\n"
                   "llama3-8b,v6e,1,1,1,1,decode,8,2048\n"
                   "deepseek-v3,v5p,32,4,1,8,prefill,1,4096\n"
                   "llama3-8b,v9,1,1,1,1,decode,8,2048\n"
                   "llama3-70b,v5e,1,1,1,1,decode,1,128\n")
    out = tmp_path / "out.csv"
    p = run("--from-csv", str(src), "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 4
    assert float(rows[0]["latency_s"]) > 0 and rows[0]["error"] == ""
    assert float(rows[1]["energy_j"]) > 0 and rows[1]["bound"]
    assert "unknown chip 'v9'" in rows[2]["error"] and rows[2]["latency_s"] == ""
    assert "does not fit" in rows[3]["error"]
    bad = tmp_path / "bad.csv"
    bad.write_text("model,chip\nllama3-8b,v6e\n")
    p = run("--from-csv", str(bad), "--out", str(out))
    assert p.returncode == 2 and "missing column" in p.stderr


def test_a_reader_that_stops_early_is_no_error():
    """`orchestrator sim step --ops | head -1`: the pipe is closed before the table is written;
    the command ends quietly (no traceback, no "Exception ignored"), status 0."""
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sim", "step", "--model",
                          "deepseek-v3", "--chip", "v6e", "--topology", "8x8", "--tp", "8",
                          "--ep", "8", "--phase", "decode", "--batch", "16", "--seq-len",
                          "700", "--ops"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()                     # the reader is gone before the first line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert err == ""
