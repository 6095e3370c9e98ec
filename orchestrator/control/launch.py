"""What a replica runs: the LaunchRequest (command, env, tags) for one replica of a service.

On the local cloud the command runs as a process from the replica environment
(`.venv-replica`); on real clouds providers put the same command in the machine's startup
script (templates install the GPU build of vLLM there).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import subprocess
from pathlib import Path

from orchestrator.common import paths
from orchestrator.common.errors import UserError
from orchestrator.spec import ServiceSpec
from orchestrator.control.store import ReplicaRow
from providers.base import LaunchRequest, Location, MachineRuntime, Market

CONNECTOR_CLASS = "SpotKVConnector"
CONNECTOR_MODULE = "orchestrator.replica.kv.connector"
REPLICA_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per CPU replica
    "HF_HUB_OFFLINE": "1",
    # vLLM's block hashes must agree across replicas even if a build falls back to hash().
    "PYTHONHASHSEED": "0",
    "PYTHONUNBUFFERED": "1",
    # Idle keep-alive connections are closed by the load balancer (after 30 s), not by the
    # replica: vLLM's default of 5 s closes them under the LB's pooled ones, and a request
    # sent as one closes is refused without an answer.
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75",
}


def service_dir(service: str) -> Path:
    path = paths.home() / "services" / service
    path.mkdir(parents=True, exist_ok=True)
    return path


def kv_secret_file(service: str) -> Path:
    """The per-service secret the shard stores and connectors authenticate with (0600)."""
    path = service_dir(service) / "kv.secret"
    if not path.exists():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    return path


@functools.lru_cache(maxsize=8)
def resolve_demo_model(size: str, replica_python: str) -> str:
    """Build (once, cached on disk) the demo model with the replica runtime; its folder."""
    try:
        out = subprocess.run(
            [replica_python, "-m", "orchestrator.replica.demo_model", "--size", size],
            capture_output=True, text=True, timeout=600, check=True,
            env={**os.environ, "SPOT_ORCHESTRATOR_MODELS": str(paths.models_dir())},
        )
    except FileNotFoundError:
        raise UserError(f"the replica runtime {replica_python} is missing; run `make install`") from None
    except subprocess.CalledProcessError as err:
        last = (err.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"building the demo model failed: {last[0]}") from None
    return out.stdout.strip().splitlines()[-1]


class ReplicaLauncher:
    """Builds the LaunchRequest of one replica; the provider's MachineRuntime says how its
    machines run the replica program, so nothing here branches on a cloud."""

    def __init__(self, daemon_url: str | None = None):
        self.daemon_url = daemon_url

    def model_path(self, spec: ServiceSpec, runtime: MachineRuntime) -> str:
        if spec.engine.is_tiny:
            return resolve_demo_model("tiny", runtime.python)
        return spec.engine.model

    def engine_args(self, spec: ServiceSpec, runtime: MachineRuntime, kv_config: dict | None) -> list[str]:
        on_cpu = runtime.on_cpu
        args = ["--model", self.model_path(spec, runtime), "--host", runtime.bind_host, "--port", "{port}"]
        args += ["--served-model-name", spec.name]
        if spec.engine.dtype or on_cpu:
            args += ["--dtype", spec.engine.dtype or "bfloat16"]
        if spec.engine.max_model_len:
            args += ["--max-model-len", str(spec.engine.max_model_len)]
        block = spec.engine.block_size_for(on_cpu)
        if block:
            args += ["--block-size", str(block)]
        if on_cpu:
            args += ["--enforce-eager"]
        if kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_config)]
        return args + list(spec.engine.args)

    def kv_config(self, spec: ServiceSpec, row: ReplicaRow, location: Location) -> dict | None:
        if not spec.kv.enabled:
            return None
        extra = {
            "k": spec.kv.k,
            "m": spec.kv.m,
            "secret_file": str(kv_secret_file(spec.name)),
            "node_id": row.replica_id,
            "cloud": location.cloud,
            "region": location.region,
            "zone": location.zone,
            "self_endpoint": "http://127.0.0.1:{agent_port}",
            "control_port": "{control_port}",
        }
        if self.daemon_url:
            # The shard stores of a service change as replicas come and go: the connector
            # asks the daemon for the current membership.
            extra["membership_url"] = f"{self.daemon_url}/v1/services/{spec.name}/stores"
        return {
            "kv_connector": CONNECTOR_CLASS,
            "kv_role": "kv_both",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_connector_extra_config": extra,
        }

    def request(self, spec: ServiceSpec, row: ReplicaRow, location: Location, market: Market,
                runtime: MachineRuntime) -> LaunchRequest:
        kv = self.kv_config(spec, row, location)
        command = [runtime.python, "-m", "orchestrator.replica.main"]
        env = dict(REPLICA_ENV)
        if kv is not None:
            secret = kv_secret_file(spec.name)
            command += ["--agent-port", "{agent_port}", "--secret-file", str(secret)]
            command += ["--store-max-bytes", str(spec.kv.store_max_bytes)]
            if not runtime.shares_host_files:
                # The machine cannot read the secret's file here: it travels in the startup
                # script's environment.
                env["SPOT_ORCHESTRATOR_KV_SECRET"] = secret.read_text().strip()
        if runtime.notice_watcher and self.daemon_url:
            # The agent watches the cloud's metadata for notices and reports them.
            command += ["--watch", runtime.notice_watcher, "--api", self.daemon_url]
        command += ["--", *self.engine_args(spec, runtime, kv)]
        acc = spec.resources.accelerator
        return LaunchRequest(
            service=spec.name,
            replica_id=row.replica_id,
            location=location,
            market=market,
            instance_type=spec.resources.instance_type or "",
            accelerator=acc.name if acc else None,
            accelerator_count=acc.count if acc else 0,
            command=command,
            env=env,
        )
