#!/usr/bin/env bash
# What a GPU replica machine needs before the daemon's launch command runs on it: vLLM's
# GPU build and this project's replica side (agent, KV connector; no control plane).
# Bake it into the image (or run it from cloud-init) for AWS, GCP and Azure replicas.
set -euo pipefail
python3 -m pip install --upgrade pip
python3 -m pip install "vllm==0.33.0"
# The project without the control plane's dependencies, plus the replica extra.
# SPOT_ORCHESTRATOR_SRC: where this repository is on the machine (a checkout, or a wheel).
: "${SPOT_ORCHESTRATOR_SRC:?set SPOT_ORCHESTRATOR_SRC to a checkout or wheel of spot-orchestrator}"
python3 -m pip install --no-deps "$SPOT_ORCHESTRATOR_SRC"
python3 -m pip install "pyeclib>=1.6" "numpy>=1.26" "httpx>=0.27" "prometheus-client>=0.20"
