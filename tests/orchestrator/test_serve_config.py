"""`orchestrator serve` settings: flags, --config files and their errors (no server starts:
every one of these is refused before anything is built)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def serve(*args, timeout=60):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def one_error_line(p):
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert "Traceback" not in p.stderr
    return lines[-1]


@pytest.mark.parametrize("args, says", [
    (("--policy", "base"), "invalid choice"),
    (("--policy-option", "no_such_rule=1"), "no such rule"),
    (("--policy-option", "coalescing"), "expected KEY=VALUE"),
    (("--policy-option", "epoch_s=soon"), "expected a number"),
    (("--port", "70000"), "--port"),
    (("--api-key-env", "NEUSCALE_TEST_UNSET_KEY_VAR"), "NEUSCALE_TEST_UNSET_KEY_VAR"),
])
def test_bad_flags_get_one_error_line(args, says):
    line = one_error_line(serve("--backend", "sim", *args))
    assert "error" in line and says in line, line


@pytest.mark.parametrize("settings, says", [
    ({"policy_name": "base"}, "policy_name must be one of neuscale, neuscale-paper"),
    ({"no_such_setting": 1}, "unknown setting 'no_such_setting'"),
    ({"port": "eighty"}, "port must be a number"),
    ({"metric": "speed"}, "metric must be energy or cost"),
])
def test_bad_config_files_get_one_error_line(tmp_path, settings, says):
    f = tmp_path / "serve.json"
    f.write_text(json.dumps(settings))
    line = one_error_line(serve("--backend", "sim", "--config", str(f)))
    assert line.startswith("error:") and says in line, line


def test_help_names_both_live_policies():
    p = serve("--help")
    assert p.returncode == 0
    assert "neuscale-paper" in p.stdout and "cheapest at its load" in p.stdout.replace("\n", " ")
