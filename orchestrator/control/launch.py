"""What a replica runs: the LaunchRequest of one replica, from the offer the policy chose.

The controller calls `ReplicaLauncher.request`. On machines of this host (the local cloud) the
request carries the command line, run from the replica environment (`.venv-replica`); on a VM
it carries the boot script (orchestrator.control.boot) that installs the replica runtime and
starts the same program. A replica of this host gets its own token (orchestrator.common.identity)
in its environment; a VM redeems it at boot. Also here: the service's KV secret file and the
demo model build.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

from orchestrator.common import identity, kvtls, paths
from orchestrator.common.errors import UserError
from orchestrator.control import auth
from orchestrator.control.kvtls import replica_files
from orchestrator.spec import ServiceSpec
from orchestrator.control.store import ReplicaRow
from orchestrator.control.boot import VM_SECRET_FILE, VM_TLS_DIR, BootScripts
from providers.base import LaunchRequest, Location, MachineRuntime, Offer
from providers.egress import egress_table

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


def kv_secret_file(service: str) -> Path:
    """The per-service secret the shard stores and connectors authenticate with (0600)."""
    path = auth.service_secret_path(service, "kv.secret")
    auth.private_secret(path)
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


# A VM has an address of its own, so its replica listens on fixed ports there (the local
# cloud's machines share this host and get free ports through placeholders instead).
VM_ENGINE_PORT = 8000
VM_AGENT_PORT = 8471
VM_CONTROL_PORT = 8472
VM_PORTS = {"port": VM_ENGINE_PORT, "agent_port": VM_AGENT_PORT, "control_port": VM_CONTROL_PORT}


class ReplicaLauncher:
    """Builds the LaunchRequest of one replica from the policy's offer. The provider's
    MachineRuntime says how its machines run the replica program: a process of this host runs
    `command`; a VM runs the boot script (`boot`), so nothing here branches on a cloud."""

    def __init__(self, daemon_url: str | None = None, boot: BootScripts | None = None):
        self.daemon_url = daemon_url
        self.boot = boot

    def model_path(self, spec: ServiceSpec, runtime: MachineRuntime) -> str:
        if spec.engine.is_tiny and runtime.on_this_host:
            return resolve_demo_model("tiny", runtime.python)
        return spec.engine.model  # a VM builds the demo model itself (orchestrator.replica.main)

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

    def kv_config(self, spec: ServiceSpec, row: ReplicaRow, location: Location, runtime: MachineRuntime) -> dict | None:
        if not spec.kv.enabled:
            return None
        tls_dir = self.tls_dir(spec, row, runtime)
        extra = {
            "k": spec.kv.k,
            "m": spec.kv.m,
            "failure_domain": spec.kv.failure_domain,
            # Shard traffic to another cloud goes over TLS, verified against the service's CA,
            # and is priced from the one egress table.
            "tls_ca_file": f"{tls_dir}/{kvtls.CA_FILE}",
            "egress": egress_table(),
            # A VM's replica writes the secret it fetched at boot to this path (replica.main).
            "secret_file": str(kv_secret_file(spec.name)) if runtime.on_this_host else VM_SECRET_FILE,
            "node_id": row.replica_id,
            "cloud": location.cloud,
            "region": location.region,
            "zone": location.zone,
            "self_endpoint": f"http://{_url_host(runtime.bind_host)}:{{agent_port}}",
            "control_port": "{control_port}",
            "control_host": runtime.bind_host,  # the daemon flushes it on a notice: reachable from there
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

    @staticmethod
    def tls_dir(spec: ServiceSpec, row: ReplicaRow, runtime: MachineRuntime) -> str:
        """Where the replica finds its shard store's TLS files: issued now into the state
        folder for a process of this host; a VM gets them at its bootstrap redemption."""
        return str(replica_files(spec.name, row.replica_id)) if runtime.on_this_host else VM_TLS_DIR

    def replica_args(self, spec: ServiceSpec, runtime: MachineRuntime, kv: dict | None) -> list[str]:
        """orchestrator.replica.main's own options (before `--` and the engine's)."""
        args: list[str] = []
        if kv is not None:
            secret = kv_secret_file(spec.name) if runtime.on_this_host else VM_SECRET_FILE
            tls_dir = kv["kv_connector_extra_config"]["tls_ca_file"].rsplit("/", 1)[0]
            args += ["--agent-port", "{agent_port}", "--secret-file", str(secret), "--tls-dir", tls_dir]
            args += ["--store-max-bytes", str(spec.kv.store_max_bytes), "--store-ttl", f"{spec.kv.ttl_seconds:g}"]
        if runtime.notice_watcher and self.daemon_url:
            # The agent watches the cloud's metadata for notices and reports them.
            args += ["--watch", runtime.notice_watcher, "--api", self.daemon_url]
        return args

    def request(self, spec: ServiceSpec, row: ReplicaRow, offer: Offer, runtime: MachineRuntime) -> LaunchRequest:
        """Raises UserError when the replica cannot be described (e.g. a VM launch without a
        daemon URL the VM can reach)."""
        kv = self.kv_config(spec, row, offer.location, runtime)
        args, engine = self.replica_args(spec, runtime, kv), self.engine_args(spec, runtime, kv)
        common = dict(
            service=spec.name,
            replica_id=row.replica_id,
            location=offer.location,
            market=offer.market,
            instance_type=offer.instance_type,
            accelerator=offer.accelerator,
            accelerator_count=offer.accelerator_count,
            price_per_hour=offer.price_per_hour,
        )
        if runtime.on_this_host:
            command = [runtime.python, "-m", "orchestrator.replica.main", *args, "--", *engine]
            # The replica's own credential for its notices and membership reads (a VM gets it
            # from the bootstrap redemption instead).
            env = {**REPLICA_ENV, identity.REPLICA_TOKEN_ENV: auth.replica_token_for(row)}
            return LaunchRequest(**common, command=command, env=env)
        if self.boot is None or not self.daemon_url:
            raise UserError(f"replica {row.replica_id}: a {offer.location.cloud} machine needs the daemon's URL "
                            "to boot; run the daemon with a public URL")
        args, engine = _fixed_ports(args), _fixed_ports(engine)
        script = self.boot.render(spec, row, runtime, args, engine, env=dict(REPLICA_ENV))
        return LaunchRequest(**common, boot_script=script, port=VM_ENGINE_PORT,
                             ports=(VM_ENGINE_PORT, VM_AGENT_PORT, VM_CONTROL_PORT), image_id=_image_for(spec, offer))


def _fixed_ports(args: list[str]) -> list[str]:
    out = []
    for arg in args:
        for name, port in VM_PORTS.items():
            arg = arg.replace("{" + name + "}", str(port))
        out.append(arg)
    return out


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _image_for(spec: ServiceSpec, offer: Offer) -> str | None:
    image = spec.image_id
    if isinstance(image, dict):  # SkyPilot's per-region form
        return image.get(offer.location.region)
    return image
