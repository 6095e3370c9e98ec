"""The daemon on `cloud: azure`: the real azure-mgmt-compute client (and ARM's generic calls)
against the emulated Resource Manager (tests/fakes/emulated_azure, without booting machines). The
first `up` creates the resource group, a virtual network per region and the service's NSG and
application security group; Spot VMs join them; a VM left Failed is deleted with its NIC, address
and disk; a daemon restart adopts the VMs; `down` leaves nothing of the service."""

from __future__ import annotations

import pytest

from providers.azure import AzureProvider, network_name
from providers.base import TAG_REPLICA, TAG_SERVICE, InstanceStatus
from tests.fakes.emulated_azure import EmulatedAzure
from tests.helpers import running_daemon, wait_for

SPEC = """
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


@pytest.fixture
def azure(monkeypatch):
    emulator = EmulatedAzure().start()
    for key, value in emulator.env().items():
        monkeypatch.setenv(key, value)
    yield emulator
    emulator.close()


def _factory(cloud: str):
    assert cloud == "azure"
    return AzureProvider(sleep=lambda s: None)  # configured from the environment only, as the daemon's


def start(monkeypatch, **kwargs):
    return running_daemon(monkeypatch, probe_interval_s=None, provider_factory=_factory,
                          public_url="http://127.0.0.1:9", **kwargs)


def managed() -> list:
    return [i for i in _factory("azure").list({TAG_SERVICE: "cloudy"}) if i.status is not InstanceStatus.TERMINATED]


def test_azure_service_makes_its_network_cleans_up_failed_vms_and_leaves_nothing(state_home, azure, monkeypatch):
    azure.fail_sizes = {"Standard_NC24ads_A100_v4"}
    with start(monkeypatch, keep_services=True) as (_, client):
        client.post("/v1/services", json={"yaml": SPEC}).raise_for_status()
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

    with start(monkeypatch) as (daemon, client):
        wait_for(lambda: client.get("/v1/services/cloudy").status_code == 200, 10, "the service restored")
        wait_for(lambda: daemon.controllers["cloudy"].reconciles >= 3, 60, "three full reconciles")
        assert {i.instance_id for i in managed()} == {i.instance_id for i in instances}
        client.delete("/v1/services/cloudy").raise_for_status()
        wait_for(lambda: client.get("/v1/services/cloudy").status_code == 404, 60, "down")
    assert not any(azure.leftovers("cloudy").values()), azure.leftovers("cloudy")
