"""LaunchRequests the way the daemon builds them: a spec, an offer, the real ReplicaLauncher
(and, for a VM, the real boot script) and the provider's own MachineRuntime. The provider
tests launch these instead of requests written by hand."""

from __future__ import annotations

from orchestrator.control.boot import BootScripts
from orchestrator.control.launch import ReplicaLauncher
from orchestrator.control.store import ReplicaRow
from orchestrator.spec import parse_spec
from providers.base import LaunchRequest, Location, Market, Offer, Provider

DAEMON_URL = "http://127.0.0.1:9"  # what the boot script names; nothing answers there in unit tests
TOKEN = "test-bootstrap-token"


def spec_for(service: str, instance_type: str, accelerator: str, location: Location, *, kv: bool = False):
    return parse_spec({
        "name": service,
        "service": {"readiness_probe": "/health", "replicas": 1},
        "resources": {"cloud": location.cloud, "region": location.region, "zone": location.zone,
                      "instance_type": instance_type, "accelerators": accelerator, "use_spot": True},
        "engine": {"model": "tiny"},
        "kv": {"enabled": kv},
    })


def launch_request(provider: Provider, replica: str, location: Location, market: Market, *,
                   service: str = "chat", instance_type: str = "g6.xlarge", accelerator: str = "L4:1",
                   price: float = 1.0, kv: bool = False, daemon_url: str = DAEMON_URL) -> LaunchRequest:
    spec = spec_for(service, instance_type, accelerator, location, kv=kv)
    name, _, count = accelerator.partition(":")
    offer = Offer(location, instance_type, name, int(count or 1), market, price, source="test")
    row = ReplicaRow(replica_id=replica, service=service, index=0, cloud=location.cloud, region=location.region,
                     zone=location.zone, market=market.value)
    boot = BootScripts(daemon_url, lambda s, r: TOKEN, lambda: "spot_orchestrator-0.1.0-py3-none-any.whl")
    return ReplicaLauncher(daemon_url=daemon_url, boot=boot).request(spec, row, offer, provider.runtime())
