#!/usr/bin/env bash
# Start-up script for NeuScale's TPU VMs (optional: the controller installs vLLM over SSH when
# `engine.check` fails; doing it at boot overlaps it with the VM's other start-up work). The
# controller puts it in every VM's metadata (startup-script) when the cluster config says
#     tpu:
#       startup_script: deploy/gcp/tpu-startup.sh
# Idempotent; logs to /var/log/neuscale-startup.log.
set -euo pipefail
exec >>/var/log/neuscale-startup.log 2>&1
echo "neuscale start-up $(date -Is)"
# vLLM for TPU (vLLM docs, "Installation - Google TPU": the vllm-tpu package)
if ! python3 -c 'import vllm' 2>/dev/null; then
    python3 -m pip install --quiet vllm-tpu
fi
# where engines keep logs, weights copied from GCS and the XLA compilation cache
install -d -m 0755 /var/lib/neuscale
# the guest agent publishes the VM's SSH host keys as guest attributes (hostkeys/): the
# controller reads them through the TPU API to verify the hosts (tpu.host_keys:
# guest-attributes). Nothing to do here unless the image disabled the agent.
echo "neuscale start-up done $(date -Is)"
