#!/usr/bin/env bash
# The project's test command (README quick start, called by .ci/run): installs everything the
# tests need on a fresh machine, then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first, pinned: the CPU build on this kind of machine's disk (a bare `torch` from PyPI is
# a multi-GB CUDA build); the extras' `torch>=2.3` is then already met
python3 -m pip install --quiet --disable-pip-version-check 'torch==2.13.0'
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
python3 -m pytest -q "$@"
