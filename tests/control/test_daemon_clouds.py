"""The daemon on `cloud: gcp` and `cloud: azure`: the real SDK clients against the emulated clouds
(tests/fakes/emulated_gcp, emulated_azure), without booting machines.

GCP: Spot VMs inserted with the service's labels and network tag; one firewall rule opens only the
replica ports to the daemon's address and the service's own VMs. Azure: the first `up` makes the
resource group, a virtual network per region and the service's NSG and application security
group; a VM left Failed is deleted with its NIC, address and disk. Both: a daemon restart adopts
the VMs (no duplicate), and `down` leaves nothing of the service."""

from __future__ import annotations

import pytest

from providers.azure import AzureProvider, network_name
from providers.base import TAG_REPLICA
from providers.gcp import GCPProvider, label, network_tag
from tests.fakes.emulated_azure import EmulatedAzure
from tests.fakes.emulated_gcp import EmulatedGCP
from tests.helpers import (
    emulator_running,
    environment_provider,
    live_instances,
    restart_adopts_then_down,
    vm_cloud_daemon,
    wait_for,
)

GCP_SPEC = """
name: cloudy
service:
  readiness_probe: {path: /health, initial_delay_seconds: 1200}
  replicas: 2
resources:
  accelerators: L4:1
  use_spot: true
  any_of: [{infra: gcp/us-central1/us-central1-a}, {infra: gcp/us-central1/us-central1-b}]
engine: {model: meta-llama/Llama-3.1-8B-Instruct}
kv: {enabled: false}
"""

AZURE_SPEC = """
name: cloudy
service:
  readiness_probe: {path: /health, initial_delay_seconds: 1200}
  replicas: 2
resources:
  accelerators: A100-80GB:1
  use_spot: true
  any_of: [{cloud: azure, region: eastus}, {cloud: azure, region: westus2}]
engine: {model: meta-llama/Llama-3.1-8B-Instruct}
kv: {enabled: false}
"""


def _emulated(monkeypatch, emulator, provider_cls, cloud: str):
    """(emulator, the daemon's provider factory, managed(): the service's live instances)."""
    factory = environment_provider(provider_cls, cloud)
    with emulator_running(monkeypatch, emulator):
        yield emulator, factory, lambda: live_instances(factory(cloud), "cloudy")


@pytest.fixture
def gcp(monkeypatch):
    yield from _emulated(monkeypatch, EmulatedGCP(), GCPProvider, "gcp")


@pytest.fixture
def azure(monkeypatch):
    yield from _emulated(monkeypatch, EmulatedAzure(), AzureProvider, "azure")


def test_gcp_service_launches_labelled_spot_vms_behind_its_own_firewall_rule_and_leaves_nothing(
        state_home, gcp, monkeypatch):
    gcp, _factory, managed = gcp
    with vm_cloud_daemon(monkeypatch, _factory, keep_services=True) as (_, client):
        client.post("/v1/services", json={"yaml": GCP_SPEC}).raise_for_status()
        wait_for(lambda: len(managed()) == 2, 60, "2 VMs in the emulated GCP")
        instances = managed()
        assert {i.market.value for i in instances} == {"spot"}
        assert {i.location.zone for i in instances} == {"us-central1-a", "us-central1-b"}
        assert {i.tags[label(TAG_REPLICA)] for i in instances} == {"cloudy-1", "cloudy-2"}
        assert all(i.instance_type.startswith("g2-") for i in instances), [i.instance_type for i in instances]
        bodies = list(gcp.instances.values())
        assert all(b["tags"]["items"] == [network_tag("cloudy")] for b in bodies)
        assert all(b["scheduling"]["provisioningModel"] == "SPOT" for b in bodies)
        script = next(i["value"] for i in bodies[0]["metadata"]["items"] if i["key"] == "startup-script")
        assert script.startswith("#!") and "http://127.0.0.1:9" in script
        rule = gcp.firewalls[network_tag("cloudy")]
        assert rule["direction"] == "INGRESS" and rule["sourceRanges"] == ["127.0.0.1/32"]
        assert rule["targetTags"] == rule["sourceTags"] == [network_tag("cloudy")]
        assert [a["IPProtocol"] for a in rule["allowed"]] == ["tcp"] and rule["allowed"][0]["ports"]
        replicas = client.get("/v1/services/cloudy").json()["replicas"]
        assert {r["instance_id"] for r in replicas} == {i.instance_id for i in instances}
        assert all(r["endpoint"] and r["endpoint"].startswith("http://127.21.") for r in replicas), replicas

    restart_adopts_then_down(monkeypatch, _factory, "cloudy", managed, {i.instance_id for i in instances})
    assert gcp.leftovers("cloudy") == {"instances": [], "disks": [], "firewall_rules": []}


def test_azure_service_makes_its_network_cleans_up_failed_vms_and_leaves_nothing(state_home, azure, monkeypatch):
    azure, _factory, managed = azure
    azure.fail_sizes = {"Standard_NC24ads_A100_v4"}
    with vm_cloud_daemon(monkeypatch, _factory, keep_services=True) as (_, client):
        client.post("/v1/services", json={"yaml": AZURE_SPEC}).raise_for_status()
        wait_for(lambda: len(azure.resources) and any(
            r["properties"]["provisioningState"] == "Failed" for (k, _), r in azure.resources.items()
            if k == "virtualMachines") or None, 60, "a VM left Failed")
        azure.fail_sizes = set()
        wait_for(lambda: len(managed()) == 2 and not any(
            r["properties"]["provisioningState"] == "Failed" for (k, _), r in azure.resources.items()
            if k == "virtualMachines"), 120, "the Failed VM deleted and 2 VMs running")
        parts = {k for k, _ in azure.resources}
        assert {"networkInterfaces", "publicIPAddresses", "disks"} <= parts
        assert len([1 for k, _ in azure.resources if k == "networkInterfaces"]) == 2, "a Failed VM's NIC leaked"
        instances = managed()
        assert azure.created[0]["properties"]["priority"] == "Spot"  # spot first; a failed one may bring cover
        assert {i.tags[TAG_REPLICA] for i in instances} <= {f"cloudy-{n}" for n in range(1, 9)}
        assert {i.location.region for i in instances} <= {"eastus", "westus2"}
        for region in {i.location.region for i in instances}:
            nsg = azure.resources[("networkSecurityGroups", network_name("cloudy", region))]
            rules = {r["name"]: r["properties"] for r in nsg["properties"]["securityRules"]}
            assert rules["daemon"]["sourceAddressPrefixes"] == ["127.0.0.1/32"]
            assert rules["deny-virtual-network"]["access"] == "Deny"
            assert ("virtualNetworks", f"spot-orchestrator-{region}") in azure.resources
        replicas = client.get("/v1/services/cloudy").json()["replicas"]
        live = [r for r in replicas if r["instance_id"] in {i.instance_id for i in instances}]
        assert len(live) == 2
        wait_for(lambda: all(r["endpoint"] and r["endpoint"].startswith("http://127.22.")
                             for r in client.get("/v1/services/cloudy").json()["replicas"]
                             if r["instance_id"] in {i.instance_id for i in instances}), 60, "private endpoints")

    restart_adopts_then_down(monkeypatch, _factory, "cloudy", managed, {i.instance_id for i in instances})
    assert not any(azure.leftovers("cloudy").values()), azure.leftovers("cloudy")
