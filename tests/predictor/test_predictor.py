"""The output-length predictor: data, head, training on real prompts, persistence checks,
the CLI, offline loading, and the micro-batching service's back-pressure."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dse.buckets import SEQ_BUCKETS
from dse.errors import NeuScaleError
from predictor.data import Pair, family_of, in_test, load_jsonl, load_log, split
from predictor.head import bucket_of, target_masks, train_head
from predictor.model import LengthModel, default_model_dir
from sim.traces import data_dir

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = data_dir() / "prompts"
ARENA = PROMPTS / "arena_prompts_multi_llm.jsonl"
TEACHER = PROMPTS / "gpteacher_gpt4.jsonl"


def cli(*args, env=None, cwd=None, prefix=()):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([*prefix, sys.executable, "-m", "orchestrator.cli", *args],
                          capture_output=True, text=True, env=e, cwd=cwd or ROOT, timeout=600)


@pytest.fixture(scope="module")
def slice_files(tmp_path_factory):
    """An eighth of the shared prompts (by prompt hash, both sources), as JSONL files."""
    d = tmp_path_factory.mktemp("prompts")
    out = []
    for src in (ARENA, TEACHER):
        lines = [ln for ln in src.read_text(encoding="utf-8").split("\n") if ln.strip()]
        keep = [ln for ln in lines if int(json.loads(ln)["prompt_sha1"][:8], 16) % 8 == 0]
        p = d / src.name
        p.write_text("\n".join(keep) + "\n", encoding="utf-8")
        out.append(p)
    return out


@pytest.fixture(scope="module")
def trained(slice_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "m"
    r = cli("predictor", "train", "--data", ",".join(map(str, slice_files)), "--out", str(out),
            "--json")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


# ---- data ----------------------------------------------------------------------------------

def test_load_real_files_and_split_by_prompt():
    pairs = load_jsonl(TEACHER)
    assert len(pairs) == 6458 and all(p.output_tokens >= 1 for p in pairs)
    arena = load_jsonl(ARENA)          # holds U+2028 inside prompts: not a line break
    assert len(arena) == 12520
    assert sum(p.censored for p in arena) == 365
    train, test = split(arena)
    tr = {p.prompt_sha1 for p in train}
    te = {p.prompt_sha1 for p in test}
    assert tr and te and not tr & te                       # a prompt is on one side only
    assert 0.1 < len(te) / (len(te) + len(tr)) < 0.3
    assert split(arena)[1] == test                         # the same split every time


def test_families():
    assert family_of("llama3-8b") == "llama"
    assert family_of("o3-mini-2025-01-31") == "reasoning"
    assert family_of("gpt-4-0314") == "gpt-4"
    assert family_of("mistralai/Mixtral-8x7B-Instruct-v0.1") == "mistral"
    assert family_of("") is None and family_of("unknown-model") is None


@pytest.mark.parametrize("content, msg", [
    ("not json\n", "not JSON"),
    ('["a list"]\n', "expected a JSON object"),
    ('{"response_tokens": 3, "prompt_tokens": 2}\n', "no 'prompt' string"),
    ('{"prompt": "x", "prompt_tokens": -1, "response_tokens": 3}\n', "non-negative integer"),
    ('{"prompt": "x", "prompt_tokens": 2, "response_tokens": "many"}\n', "non-negative integer"),
    ("\n\n", "no prompt/answer pairs"),
])
def test_bad_data_files(tmp_path, content, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(NeuScaleError, match=msg):
        load_jsonl(p)
    with pytest.raises(NeuScaleError, match="no prompt data file"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_served_log(tmp_path):
    from orchestrator.state import StateStore
    db = tmp_path / "state.db"
    st = StateStore(db)
    rec = {"t": 1.0, "endpoint": "completions", "status": 200, "prompt_tokens": 5,
           "predicted_tokens": 10, "prefill_group": None, "decode_group": "g", "migrations": 0,
           "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 1.0}
    st.log_requests([
        dict(rec, id="a", output_tokens=40, finish_reason="stop", prompt="write a poem"),
        dict(rec, id="b", output_tokens=64, finish_reason="length", prompt="write a story"),
        dict(rec, id="c", output_tokens=7, finish_reason="stop", prompt=None),
        dict(rec, id="d", output_tokens=7, finish_reason="stop", prompt="x", status=500)])
    pairs = sorted(load_log(db), key=lambda p: p.prompt)
    assert [(p.prompt, p.output_tokens, p.censored) for p in pairs] == [
        ("write a poem", 40, False), ("write a story", 64, True)]
    empty = tmp_path / "empty.db"
    StateStore(empty)
    with pytest.raises(NeuScaleError, match="--log-prompts"):
        load_log(empty)
    (tmp_path / "junk.db").write_bytes(b"not sqlite" * 100)
    with pytest.raises(NeuScaleError, match="not a served-request log"):
        load_log(tmp_path / "junk.db")


# ---- the head ------------------------------------------------------------------------------

def test_censored_answers_push_mass_up():
    """Answers cut at a cap say only 'at least': a head trained on them must not learn that
    the answers end at the cap."""
    edges = (128, 256, 512, 1024, 2048, 4096)
    rng = np.random.default_rng(0)
    n = 600
    x = rng.standard_normal((n, 4)).astype(np.float32)
    cens = np.ones(n, bool)                 # every answer was cut at 1000 tokens
    obs = np.full(n, 1000)
    head, _ = train_head(x, target_masks(edges, obs, cens), epochs=30, seed=0)
    p = head.probs(x).mean(axis=0)
    assert p[:bucket_of(edges, 1000)].sum() < 0.05       # nothing below the cap
    # treated as exact, the same data teach the wrong answer
    head2, _ = train_head(x, target_masks(edges, obs, np.zeros(n, bool)), epochs=30, seed=0)
    assert head2.probs(x).mean(axis=0)[bucket_of(edges, 1000)] > 0.9


def test_remaining_point_conditions_on_generated():
    model = LengthModel.load()
    p = np.zeros(len(model.edges))
    p[0], p[3] = 0.7, 0.3                    # most answers short, some ~400-512
    model.bucket_median = None
    assert model.point(p) <= 128
    r = model.remaining_point(p, 200)        # it outlived the short ones
    assert 384 < r <= 512
    assert model.remaining_point(p, 600) > 600   # beyond the support: still longer


# ---- persistence ---------------------------------------------------------------------------

def test_shipped_model_loads_and_is_checked(tmp_path):
    m = LengthModel.load(edges=SEQ_BUCKETS)
    assert m.edges == SEQ_BUCKETS and m.manifest["eval"]["all"]["model"]["n"] > 1000
    with pytest.raises(NeuScaleError, match="trained for 48 buckets"):
        LengthModel.load(edges=SEQ_BUCKETS[:10])
    with pytest.raises(NeuScaleError, match="no predictor model"):
        LengthModel.load(tmp_path / "nope")
    bad = tmp_path / "bad"
    shutil.copytree(default_model_dir(), bad)
    (bad / "head.npz").write_bytes(b"garbage")
    with pytest.raises(NeuScaleError, match="damaged"):
        LengthModel.load(bad)
    man = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps(dict(man, kind="something-else")))
    with pytest.raises(NeuScaleError, match="not a NeuScale length-predictor"):
        LengthModel.load(bad)
    (bad / "manifest.json").write_text("{")
    with pytest.raises(NeuScaleError, match="not JSON"):
        LengthModel.load(bad)


def test_encoder_mismatch_is_refused(tmp_path):
    other = tmp_path / "m"
    shutil.copytree(default_model_dir(), other)
    man = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(dict(man, encoder="bert:000000000000")))
    m = LengthModel.load(other)
    with pytest.raises(NeuScaleError, match="trained on encoder bert:000000000000"):
        m.attach_encoder()


# ---- training on real prompts --------------------------------------------------------------

def test_training_on_a_slice_beats_both_baselines(trained):
    out, res = trained
    ev = res["eval"]["all"]
    n = ev["model"]["n"]
    assert n > 200
    for base in ("global_median", "input_median"):
        assert ev["model"]["bucket_accuracy"] > ev[base]["bucket_accuracy"] + 0.1, (base, ev)
        assert ev["model"]["within_1_bucket"] > ev[base]["within_1_bucket"], (base, ev)
        assert ev["model"]["mae_tokens"] < ev[base]["mae_tokens"], (base, ev)
    man = json.loads((out / "manifest.json").read_text())
    hist = man["history"]
    assert man["epochs_run"] >= 3 and hist
    assert {s["file"] for s in man["trained_on"]} == {ARENA.name, TEACHER.name}


def test_eval_uses_held_out_prompts_only(trained, slice_files):
    out, _ = trained
    r = cli("predictor", "eval", "--data", str(slice_files[1]), "--model", str(out), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert "held-out" in res["data"][0]
    held = sum(in_test(p.prompt_sha1) for p in load_jsonl(slice_files[1]))
    assert res["all"]["model"]["n"] == held
    assert res["calibration"] and res["per_source"]


def test_predict_cli(trained):
    out, _ = trained
    r = cli("predictor", "predict", "Write a haiku about the sea.", "--model", str(out),
            "--json")
    assert r.returncode == 0, r.stderr
    a = json.loads(r.stdout)
    assert a["predicted_output_tokens"] >= 1 and len(a["top_buckets"]) == 3
    r = cli("predictor", "predict", "Write a haiku about the sea.", "--model", str(out),
            "--generated", "700", "--json")
    assert json.loads(r.stdout)["predicted_output_tokens"] > 700


@pytest.mark.parametrize("args, msg", [
    (("predictor", "predict", "hi", "--model", "/nonexistent/m"), "no predictor model"),
    (("predictor", "eval", "--data", "/nonexistent.jsonl"), "no prompt data file"),
    (("predictor", "train"), "needs --data"),
    (("predictor", "train", "--data", "/etc/hostname", "--out", "/tmp/x-neuscale-pred"),
     "not JSON"),
    (("predictor", "predict", "hi", "--generated", "-3"), "--generated"),
])
def test_cli_bad_input_is_one_error_line(args, msg):
    r = cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], r.stderr


def _no_network_prefix() -> tuple[str, ...]:
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"]).returncode == 0:
        return ("unshare", "-n")
    return ()


def test_loads_with_no_network():
    """Weights come from the installed package, never a hub: with no network at all (a fresh
    network namespace, or proxies to a closed port) the shipped model predicts."""
    env = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
           "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": ""}
    r = cli("predictor", "predict", "Explain TCP slow start in two sentences.", "--json",
            env=env, prefix=_no_network_prefix())
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["predicted_output_tokens"] >= 1


# ---- the service ---------------------------------------------------------------------------

def test_service_batches_and_refuses_when_full():
    from predictor.service import BertPredictor, PredictorBusy
    prompts = [p.prompt for p in load_jsonl(TEACHER)[:40]]

    async def go():
        bp = BertPredictor(max_batch=16, max_wait_s=0.01, max_queue=64, timeout_s=30)
        try:
            got = await asyncio.gather(*(bp.predict(t, 20) for t in prompts))
            assert all(g >= 1 for g in got)
            st = bp.stats()
            assert st["batched"] == 40 and st["batches"] < 40      # forward passes shared
            # a re-prediction of a known prompt needs no forward pass
            r = await bp.repredict(prompts[0], 20, 300)
            assert r > 300 and bp.stats()["batches"] == st["batches"]
            tight = BertPredictor(bp.model, max_batch=4, max_wait_s=0.0, max_queue=2,
                                  timeout_s=30)
            res = await asyncio.gather(*(tight.predict(f"new prompt {i}", 5)
                                         for i in range(20)), return_exceptions=True)
            busy = [x for x in res if isinstance(x, PredictorBusy)]
            assert busy and tight.stats()["refused"] == len(busy)
            assert any(isinstance(x, int) for x in res)
            await tight.aclose()
        finally:
            await bp.aclose()

    asyncio.run(go())


def test_auto_falls_back_when_the_model_is_missing(monkeypatch, tmp_path):
    import predictor.model as pm
    from router.predict import MedianPredictor, make_predictor
    monkeypatch.setattr(pm, "default_model_dir", lambda: tmp_path / "missing")
    p = make_predictor("auto")
    assert isinstance(p, MedianPredictor) and p.configured == "bert"
    assert "no predictor model" in p.fallback_reason
    with pytest.raises(ValueError, match="cannot load"):
        make_predictor("bert")
    monkeypatch.undo()
    from predictor.service import BertPredictor
    assert isinstance(make_predictor("bert", serving_model="llama3-8b"), BertPredictor)


def test_served_log_round_trip_trains(tmp_path, slice_files):
    """--from-log: what the gateway logged (with --log-prompts) is training data."""
    from orchestrator.state import StateStore
    db = tmp_path / "state.db"
    st = StateStore(db)
    recs = []
    for i, p in enumerate(load_jsonl(slice_files[1])[:300]):
        recs.append({"id": str(i), "t": float(i), "endpoint": "chat", "status": 200,
                     "prompt_tokens": p.prompt_tokens, "output_tokens": p.output_tokens,
                     "predicted_tokens": 1, "prefill_group": None, "decode_group": "g",
                     "migrations": 0, "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 1.0,
                     "finish_reason": "stop", "prompt": p.prompt})
    st.log_requests(recs)
    out = tmp_path / "m"
    r = cli("predictor", "train", "--from-log", str(db), "--out", str(out), "--json",
            "--epochs", "5")
    assert r.returncode == 0, r.stderr
    man = json.loads((out / "manifest.json").read_text())
    assert man["trained_on"] == [{"log": "state.db"}]
    assert man["rows"]["fit"] + man["rows"]["validation"] + man["rows"]["test"] == 300
    con = sqlite3.connect(db)
    assert con.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 300


def test_pair_defaults():
    p = Pair("hello", 1, 2)
    assert p.family is None and not p.censored


def test_onnx_runtime_agrees_with_torch():
    """The ONNX graph is exported from the torch model once and gives the same embeddings."""
    from predictor.encoder import Encoder
    texts = ["A short one.", "Write a long essay about the history of the printing press, "
             "its inventors, and its effect on literacy in Europe." * 3]
    t = Encoder(runtime="torch")
    o = Encoder(runtime="onnx")
    assert o.runtime == "onnx" and t.runtime == "torch" and o.name == t.name
    assert np.abs(t.encode(texts) - o.encode(texts)).max() < 1e-4
    assert Encoder().runtime == "onnx"          # auto takes ONNX Runtime when installed
    with pytest.raises(NeuScaleError, match="unknown encoder runtime"):
        Encoder(runtime="tpu")
