"""`orchestrator simulate` end to end on a slice of the real 2023 Azure code trace."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args, cache=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if cache:
        env["NEUSCALE_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "simulate", *args],
                          capture_output=True, text=True, env=env, timeout=900)


def test_json_report_shape_ratios_and_outputs(tmp_path):
    p = run("--model", "llama3-8b", "--trace", "azure-code-2023", "--hours", "0.1",
            "--chip-mix", "v5e,v5p,v6e", "--out", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert set(r["policies"]) == {"neuscale", "base", "ideal"}
    for name, v in r["policies"].items():
        for ph in ("prefill", "decode"):
            for k in ("requests", "tokens", "energy_j", "cost_usd", "tokens_per_j",
                      "tokens_per_usd", "slo_rate"):
                assert k in v[ph], (name, ph, k)
            assert v[ph]["energy_j"] > 0 and 0 <= v[ph]["slo_rate"] <= 1
    assert r["policies"]["neuscale"]["prefill"]["requests"] == r["trace"]["requests"]
    assert r["ratios_vs_base"]["base"]["decode"]["tokens_per_j"] == 1.0
    assert r["ratios_vs_base"]["ideal"]["decode"]["tokens_per_j"] > 1.0
    assert (tmp_path / "summary.json").exists()
    timeline = (tmp_path / "timeline_neuscale.csv").read_text().splitlines()
    assert timeline[0] == "t_s,phase,group,vpods_target,min_len,max_len"
    # per epoch and phase, the groups' length ranges tile 1..the largest bucket
    spans: dict = {}
    for row in timeline[1:]:
        t, ph, g, _, lo, hi = row.split(",")
        if lo:
            spans.setdefault((t, ph), []).append((int(lo), int(hi)))
    assert spans
    for ranges in spans.values():
        ranges.sort()
        assert ranges[0][0] == 1 and all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))
    minutes = (tmp_path / "minutes_neuscale.csv").read_text().splitlines()
    assert minutes[0] == "t_s,phase,group,vpods,energy_j,finished,slo_rate"
    totals = [row.split(",") for row in minutes[1:] if row.split(",")[2] == "*"]
    assert totals[0][:2] == ["60", "prefill"] and int(totals[0][3]) >= 1
    # every prefill finishes within the run: the minutes' counts add up to the requests
    # (the last, partial minute aside)
    done = sum(int(t[5]) for t in totals if t[1] == "prefill")
    assert 0.8 * r["trace"]["requests"] <= done <= r["trace"]["requests"]
    pngs = {Path(f).name for f in r["plots"]}
    assert {"efficiency_slo.png", "vpods_neuscale.png", "vpods_base.png", "minutes.png",
            "vs_length.png", "targets_neuscale.png", "allocations_neuscale.png"} <= pngs
    assert all((tmp_path / f).read_bytes()[:4] == b"\x89PNG" for f in pngs)


def test_user_errors():
    p = run("--model", "llama3-8b", "--trace", "no-such-trace", "--db", "x.json")
    assert p.returncode == 2 and "error:" in p.stderr
    p = run("--model", "llama3-8b", "--trace", "azure-code-2023", "--policy", "magic")
    assert p.returncode == 2 and "unknown policy 'magic'" in p.stderr
    p = run("--model", "llama3-8b", "--trace", "azure-code-2023", "--quota", "v5p:4")
    assert p.returncode == 2 and "CHIP=CHIPS" in p.stderr
    p = run("--model", "llama3-8b", "--trace", "azure-code-2023", "--accuracy", "1.5")
    assert p.returncode == 2 and "between 0 and 1" in p.stderr
    p = run("--model", "llama3-8b", "--trace", "azure-code-2023", "--chip-mix", "gpu=v6e")
    assert p.returncode == 2 and "PHASE=CHIP" in p.stderr
