"""`sim bench`: a workload on one allocation's simulated engine, measured as a benchmark client
measures it."""
import csv
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from dse.catalog import default_catalog
from dse.errors import NeuScaleError
from dse.models import load_model
from dse.stacks import get_stack
from sim.bench import BenchConfig, Lengths, Workload, bench_config, run
from sim.chip import ChipModel
from sim.engine import Engine
from sim.stepcost import StepCostTable


def cfg(**kw):
    base = dict(model="llama3-8b", chip="v6e", tp=1, requests=20,
                input_tokens=Lengths(1000, 1000), output_tokens=Lengths(50, 50))
    base.update(kw)
    return BenchConfig(**base)


def table(stack="vllm-tpu"):
    return StepCostTable(ChipModel.of(load_model("llama3-8b"), default_catalog(), "v6e", "1x1",
                                      1, stack=stack))


def test_one_client_sees_request_time_plus_one_prefill_step_and_decode_steps():
    """closed:1 - nothing else runs: TTFT = the stack's request time + the prompt's step,
    TPOT = the mean decode step over the KV lengths the answer passes."""
    st = get_stack("vllm-tpu")
    r = run(cfg(workload=Workload.parse("closed:1"), requests=3))
    t = table()
    prefill_s = t.step(1000.0, 1000 * 1001 / 2, 0.0, 0.0)[0]
    assert r["ttft_mean_s"] == pytest.approx(st.request_s + prefill_s, rel=1e-9)
    dec = np.mean([t.step(0.0, 0.0, 1.0, float(kv))[0] for kv in range(1001, 1050)])
    assert r["tpot_mean_s"] == pytest.approx(dec, rel=1e-6)
    assert r["req_per_s"] == pytest.approx(3 / r["makespan_s"])


def test_overlapping_host_time_is_a_floor_not_an_addend():
    """With async scheduling a step takes max(device, host): a host slower than the device
    sets the TPOT; without overlap the two add up."""
    base = get_stack("none")
    slow = dataclasses.replace(base, name="slow", step_s=0.050)
    over = dataclasses.replace(slow, overlap=True)
    c = dict(workload=Workload.parse("closed:1"), requests=2)
    dev = run(cfg(stack=base, **c))["tpot_mean_s"]
    assert dev < 0.050
    assert run(cfg(stack=over, **c))["tpot_mean_s"] == pytest.approx(0.050, rel=1e-9)
    assert run(cfg(stack=slow, **c))["tpot_mean_s"] == pytest.approx(dev + 0.050, rel=1e-6)


def test_more_sequences_per_step_raise_burst_throughput_and_tpot():
    small = run(cfg(max_num_seqs=4, requests=64))
    big = run(cfg(max_num_seqs=64, requests=64))
    assert big["output_tok_per_s"] > 2 * small["output_tok_per_s"]
    assert big["tpot_mean_s"] > small["tpot_mean_s"]


def test_poisson_light_load_runs_at_the_offered_rate():
    r = run(cfg(workload=Workload.parse("poisson:0.5"), requests=200, seed=3))
    assert r["req_per_s"] == pytest.approx(0.5, rel=0.15)
    assert r["ttft_p99_s"] < 1.0          # no queue at 0.5 req/s on a whole v6e


def test_uniform_lengths_and_trace_lengths():
    r = run(cfg(input_tokens=Lengths(10, 20), output_tokens=Lengths(5, 9), requests=400))
    assert 14 * 400 <= r["total_tok_per_s"] * r["makespan_s"] - 7 * 400 <= 16 * 400
    t = run(cfg(trace="azure-conv-2023", requests=50))
    assert t["input_tokens"] == "trace=azure-conv-2023"
    assert t["output_tok_per_s"] != run(cfg(requests=50))["output_tok_per_s"]


def test_pipeline_parallel_runs_one_engine_per_stage():
    r = run(cfg(model="llama3-70b", chip="v6e", tp=4, pp=2, topology="2x4", requests=16,
                workload=Workload.parse("closed:8")))
    assert r["pp"] == 2 and r["req_per_s"] > 0 and r["tpot_mean_s"] > 0


def test_without_chunked_prefill_a_step_prefills_whole_prompts_or_decodes():
    """vLLM without chunked prefill / JetStream: no step mixes prompt tokens and decodes, a
    prompt is never split, and one over the token budget is refused."""
    steps = []

    class Spy:
        def __init__(self, t):
            self.t = t
            for k in ("kv_capacity_tokens", "kv_bytes_per_token", "host_bw_bytes_per_s",
                      "static_power_w", "num_chips"):
                setattr(self, k, getattr(t, k))

        def step(self, p, ctx, n, kv):
            steps.append((float(np.max(p)), float(np.max(n))))
            return self.t.step(p, ctx, n, kv)
    e = Engine(Spy(table()), "mixed", max_batch=8, max_batched_tokens=3000, exact=True,
               chunked_prefill=False)
    for i in range(6):
        e.submit(i, 0.01 * i, 1000, 20)
    e.run_until_idle()
    assert len(e.finished) == 6
    assert all(p == 0 or n == 0 for p, n in steps)
    assert {p for p, _ in steps if p} <= {1000.0, 2000.0, 3000.0}
    with pytest.raises(ValueError, match="without chunked prefill"):
        e.submit(99, 1.0, 3001, 5)
    chunked = Engine(table(), "mixed", max_batch=8, max_batched_tokens=3000)
    with pytest.raises(ValueError):
        chunked.submit(0, 0.0, 10**7, 5)         # the KV cache is the only limit there


@pytest.mark.parametrize("field,value,msg", [
    ("workload", "closed:0", "closed:C"), ("workload", "fast", "burst, closed:C"),
    ("workload", "poisson:-1", "poisson:R"), ("input_tokens", "9-3", "A <= B"),
    ("output_tokens", "x", "number of tokens"), ("tp", "two", "integer"),
    ("chunked_prefill", "maybe", "true or false"), ("stack", "trt", "unknown serving stack")])
def test_bad_values_are_one_clear_error(field, value, msg):
    row = {"model": "llama3-8b", "chip": "v6e", "tp": "1", field: value}
    with pytest.raises(NeuScaleError, match=msg):
        run(bench_config(row.get))


def test_a_model_that_does_not_fit_is_an_error():
    with pytest.raises(NeuScaleError, match="does not fit"):
        run(cfg(model="llama3-70b", chip="v5e", tp=1, topology="1x1"))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "sim", "bench", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_json_and_csv_with_bad_rows_and_copied_columns(tmp_path):
    p = _cli("--model", "llama3-8b", "--chip", "v6e", "--tp", "1", "--workload", "closed:4",
             "--requests", "8", "--json")
    assert p.returncode == 0, p.stderr
    import json
    out = json.loads(p.stdout)
    assert out["workload"] == "closed:4" and out["tpot_p99_s"] >= out["tpot_p50_s"] > 0
    src = tmp_path / "in.csv"
    src.write_text("label,model,chip,topology,tp,pp,ep,stack,max_num_seqs,max_batched_tokens,"
                   "workload,requests,input_tokens,output_tokens\n"
                   "ok,llama3-8b,v6e,1x1,1,1,1,vllm-tpu,64,8192,burst,16,100-200,20\n"
                   "bad,llama3-8b,v6e,1x1,1,1,1,vllm-tpu,64,8192,closed:x,16,100,20\n"
                   "nofit,llama3-70b,v5e,1x1,1,1,1,jetstream,64,8192,burst,16,100,20\n")
    dst = tmp_path / "out.csv"
    p = _cli("--from-csv", str(src), "--out", str(dst))
    assert p.returncode == 0, p.stderr
    assert "3 rows, 2 errors" in p.stdout
    rows = list(csv.DictReader(dst.open()))
    assert [r["label"] for r in rows] == ["ok", "bad", "nofit"]
    assert float(rows[0]["req_per_s"]) > 0 and not rows[0]["error"]
    assert "closed:C" in rows[1]["error"] and not rows[1]["req_per_s"]
    assert "does not fit" in rows[2]["error"]


def test_cli_errors_are_one_line(tmp_path):
    p = _cli("--model", "llama3-8b", "--chip", "v6e")
    assert p.returncode == 2 and p.stderr.startswith("error:") and "--tp" in p.stderr
    p = _cli("--model", "llama3-8b", "--chip", "v6e", "--tp", "1", "--stack", "trt")
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    bad = tmp_path / "b.csv"
    bad.write_text("model,chip\nllama3-8b,v6e\n")
    p = _cli("--from-csv", str(bad), "--out", str(tmp_path / "o.csv"))
    assert p.returncode == 2 and "missing column" in p.stderr and "Traceback" not in p.stderr
