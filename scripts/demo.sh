#!/usr/bin/env bash
# The local demo: a service on the `local` cloud with two vLLM (CPU) replicas in two
# simulated zones behind an OpenAI-compatible endpoint. Leaves it running; prints how to use it.
set -euo pipefail
cd "$(dirname "$0")/.."
SPOTCTL=.venv/bin/spotctl
echo "==> starting the demo service (first start builds the tiny demo model; replicas need ~1-2 min)"
$SPOTCTL up templates/local-tiny.yaml --wait --timeout 900
ENDPOINT=$($SPOTCTL status demo --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["endpoint"])')
$SPOTCTL status demo
cat <<MSG

The service is up at $ENDPOINT (OpenAI-compatible). Try:

  curl $ENDPOINT/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "demo", "prompt": "The quick brown fox", "max_tokens": 16}'

  curl -N $ENDPOINT/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "demo", "stream": true, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'

Then: .venv/bin/spotctl status -v | chaos preempt demo-1 --grace 30 | events demo | logs demo | down demo -y
MSG
