#!/bin/bash
# spot-orchestrator: the boot script of one replica machine, the same on every cloud (the
# daemon renders it into the VM's user-data, startup-script or customData). It installs the
# replica runtime at exactly the daemon's version, then runs it; no secret is in here (the
# replica fetches its secrets once, with the one-time bootstrap token below).
set -euo pipefail
export HOME="$${HOME:-/root}"
DAEMON_URL=${daemon_url}
BOOT_TOKEN=${bootstrap_token}
WORK="$$HOME/.spot-orchestrator"
mkdir -p "$$WORK" && chmod 700 "$$WORK"
exec >>"$$WORK/boot.log" 2>&1
echo "boot: $$(date -u +%FT%TZ) replica ${replica_id} of ${service}"
${env_exports}

# Install step: uv, Python ${python_version}, and the daemon's own wheel with vLLM's GPU build
# (the version pinned in the project's `gpu` extra). An environment that already holds the
# replica runtime is used as it is when SPOT_ORCHESTRATOR_REPLICA_PYTHON names it.
PY="$${SPOT_ORCHESTRATOR_REPLICA_PYTHON:-}"
if [ -z "$$PY" ]; then
  export PATH="$$HOME/.local/bin:$$PATH"
  command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
  uv python install ${python_version}
  uv venv --allow-existing --python ${python_version} "$$WORK/venv"
  curl -fsS --retry 20 --retry-all-errors --retry-delay 3 -H "Authorization: Bootstrap $$BOOT_TOKEN" \
    -o "$$WORK/${wheel_name}" "$$DAEMON_URL/v1/bootstrap/wheel"
  uv pip install --python "$$WORK/venv/bin/python" "$$WORK/${wheel_name}[replica,gpu]"
  PY="$$WORK/venv/bin/python"
fi

exec "$$PY" -m orchestrator.replica.main --cloud ${cloud} --daemon "$$DAEMON_URL" \
  --bootstrap-token "$$BOOT_TOKEN" --home "$$WORK" ${replica_command}
