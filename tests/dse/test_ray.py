"""`dse build --ray local` lowers on a real (local, loopback-only) Ray instance."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(tmp_path, cache, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), NEUSCALE_CACHE_DIR=str(tmp_path / cache))
    out = tmp_path / f"{cache}.json"
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "dse", "build", "--model",
                        "llama3-8b", "--chips", "v6e", "--out", str(out), "--json", *extra],
                       capture_output=True, text=True, env=env, timeout=600)
    return p, out


def test_ray_and_local_processes_give_the_same_fits_and_db(tmp_path):
    p_ray, db_ray = build(tmp_path, "ray", "--ray", "local")
    assert p_ray.returncode == 0, p_ray.stderr
    p_loc, db_loc = build(tmp_path, "local", "--workers", "2")
    assert p_loc.returncode == 0, p_loc.stderr
    fits = [json.loads(next((tmp_path / c).rglob("*.json")).read_text())["fits"]
            for c in ("ray", "local")]
    assert fits[0] == fits[1] and len(fits[0]) == 24
    entries = [json.loads(p.read_text())["entries"] for p in (db_ray, db_loc)]
    assert entries[0] == entries[1]


def test_unreachable_ray_address_fails_fast_with_one_line(tmp_path):
    p, _ = build(tmp_path, "bad", "--ray", "127.0.0.1:1")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: cannot reach the Ray cluster")
