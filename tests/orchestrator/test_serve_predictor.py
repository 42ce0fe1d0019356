"""The BERT predictor in the live stack: `serve --predictor bert` routes decode by its
predictions (the served-request log holds exactly what the model predicts offline for the same
prompt), and /metrics shows which predictor answers and predicted against actual per group."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys

from openai import OpenAI

from dse.tokens import count_tokens
from predictor.model import LengthModel

from test_serve_e2e import ROOT, Serve, kill_cloud, wait_for


def test_serve_routes_by_the_bert_predictor(tmp_path, llama8b_db):
    s = Serve(tmp_path, "--db", str(llama8b_db[1]), "--predictor", "bert", "--log-prompts",
              "--policy", "neuscale-paper")
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = ["Write a Python function that checks whether a string is a palindrome.",
                   "You are a pirate captain. Greet your new crew in one sentence.",
                   "Compare the economic policies of three 20th-century governments in a "
                   "detailed essay with sources.",
                   "Translate 'good morning' into French."]
        done = 0
        for p in prompts:
            r = c.completions.create(model="llama3-8b", prompt=p, max_tokens=2000)
            done += r.choices[0].finish_reason == "stop"
        text = s.get("/metrics")[1]
        assert re.search(r'^neuscale_predictor_active\{configured="bert",predictor="bert"\} 1\.0$',
                         text, re.M), text[:2000]
        got = sum(float(x) for x in re.findall(
            r"^neuscale_prediction_requests_total\{group=\"[^\"]+\"\} ([0-9.e+]+)$", text, re.M))
        assert got == done >= 1
        assert re.search(r"^neuscale_predicted_output_tokens_total\{", text, re.M)
        assert re.search(r"^neuscale_actual_output_tokens_total\{", text, re.M)
        # the log holds the BERT model's own prediction for each prompt
        model = LengthModel.load()
        model.attach_encoder()

        def logged():
            return dict(sqlite3.connect(s.state).execute(
                "SELECT prompt, predicted_tokens FROM requests WHERE prompt IS NOT NULL"
            ).fetchall())

        rows = wait_for(lambda: len(logged()) >= len(prompts) and logged(), 30)
        for p in prompts:
            dist = model.distribution_from_emb(model.embed([p]), [count_tokens(p)], ["llama"])[0]
            assert rows[p] == min(model.point(dist), 2000), p
    finally:
        s.stop()
        kill_cloud(s.state)


def test_serve_refuses_a_missing_bert_model(tmp_path, llama8b_db):
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "--backend", "sim",
                        "--db", str(llama8b_db[1]), "--port", "0", "--state",
                        str(tmp_path / "s.db"), "--predictor", f"bert:{tmp_path}/none"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2
    assert "error: --predictor: the BERT predictor cannot load: no predictor model" in r.stderr
