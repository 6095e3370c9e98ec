"""The daemon on `cloud: gcp`: the real google-cloud-compute client against the emulated Compute
Engine API (tests/fakes/emulated_gcp, without booting machines). Spot VMs are inserted with the
service's labels and network tag, one firewall rule opens only the replica ports to the daemon's
address and the service's own VMs, a daemon restart adopts the VMs (no duplicate), and `down`
leaves no VM, disk or firewall rule behind."""

from __future__ import annotations

import pytest

from providers.base import TAG_REPLICA, TAG_SERVICE, InstanceStatus
from providers.gcp import GCPProvider, label, network_tag
from tests.fakes.emulated_gcp import EmulatedGCP
from tests.helpers import running_daemon, wait_for

SPEC = """
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


@pytest.fixture
def gcp(monkeypatch):
    emulator = EmulatedGCP().start()
    for key, value in emulator.env().items():
        monkeypatch.setenv(key, value)
    yield emulator
    emulator.close()


def _factory(cloud: str):
    assert cloud == "gcp"
    return GCPProvider(sleep=lambda s: None)  # configured from the environment only, as the daemon's


def start(monkeypatch, **kwargs):
    # The URL its VMs would reach it at (nothing boots here; the boot scripts only name it).
    return running_daemon(monkeypatch, probe_interval_s=None, provider_factory=_factory,
                          public_url="http://127.0.0.1:9", **kwargs)


def managed() -> list:
    return [i for i in _factory("gcp").list({TAG_SERVICE: "cloudy"}) if i.status is not InstanceStatus.TERMINATED]


def test_gcp_service_launches_labelled_spot_vms_behind_its_own_firewall_rule_and_leaves_nothing(
        state_home, gcp, monkeypatch):
    with start(monkeypatch, keep_services=True) as (_, client):
        client.post("/v1/services", json={"yaml": SPEC}).raise_for_status()
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

    # A new daemon on the same state finds the same VMs and launches nothing new.
    with start(monkeypatch) as (daemon, client):
        wait_for(lambda: client.get("/v1/services/cloudy").status_code == 200, 10, "the service restored")
        wait_for(lambda: daemon.controllers["cloudy"].reconciles >= 3, 60, "three full reconciles")
        assert {i.instance_id for i in managed()} == {i.instance_id for i in instances}
        client.delete("/v1/services/cloudy").raise_for_status()
        wait_for(lambda: client.get("/v1/services/cloudy").status_code == 404, 60, "down")
    assert gcp.leftovers("cloudy") == {"instances": [], "disks": [], "firewall_rules": []}
