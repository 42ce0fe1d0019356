#!/usr/bin/env bash
# The project's test command (README quick start, called by .ci/run): installs everything the
# tests need on a fresh machine, then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
python3 -m pytest -q "$@"
