"""The spec's shard-store settings reach the agent: the daemon's launcher writes the replica
program's options (orchestrator.control.launch), the replica program turns them into the
agent's command line (orchestrator.replica.main.agent_command)."""

from __future__ import annotations

from orchestrator.control.launch import ReplicaLauncher
from orchestrator.replica.main import agent_command, fill, parse
from orchestrator.spec import parse_spec
from providers.base import MachineRuntime
from tests.spec.test_spec import spec_of


def _agent(kv: dict) -> list[str]:
    spec = parse_spec(spec_of(kv=kv))
    launcher = ReplicaLauncher()
    runtime = MachineRuntime(on_this_host=True)
    kv_config = {"kv_connector_extra_config": {"tls_ca_file": "/tmp/tls/ca.pem"}}
    args = fill(launcher.replica_args(spec, runtime, kv_config), {"agent_port": "7001"})
    opts, _engine = parse([*args, "--", "--model", "tiny"])
    opts.host = "127.0.0.1"  # main() takes it from the engine's --host
    return agent_command(opts)


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_specs_store_bound_and_ttl_reach_the_agent():
    command = _agent({"store_max_bytes": "2GiB", "ttl_seconds": 90})
    assert _option(command, "--max-bytes") == str(2 * 1024**3)
    assert _option(command, "--ttl") == "90"
    assert _option(command, "--store-port") == "7001"


def test_the_default_ttl_is_the_specs_default():
    assert _option(_agent({}), "--ttl") == f"{parse_spec(spec_of()).kv.ttl_seconds:g}"
