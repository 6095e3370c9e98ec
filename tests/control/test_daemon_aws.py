"""The daemon on `cloud: aws`: real boto3 against moto's server. Spot instances are launched
through the SDK, tagged with service and replica id, found again by tag after a daemon
restart (no duplicate launch), and terminated by `down`."""

from __future__ import annotations

import pytest

from providers.aws import AWSProvider
from providers.base import TAG_REPLICA, TAG_SERVICE, InstanceStatus
from tests.helpers import moto_session, running_daemon, wait_for

REGION = "us-east-1"
SPEC = f"""
name: cloudy
service:
  readiness_probe: {{path: /health, initial_delay_seconds: 1200}}
  replicas: 2
resources:
  cloud: aws
  region: {REGION}
  accelerators: L4:1
  instance_type: g6.xlarge
  use_spot: true
  any_of: [{{zone: us-east-1a}}, {{zone: us-east-1b}}]
engine: {{model: meta-llama/Llama-3.1-8B-Instruct}}
kv: {{enabled: false}}
"""


@pytest.fixture
def aws_factory(moto_url, moto_image):
    session = moto_session(REGION)

    def make(cloud: str):
        assert cloud == "aws"
        return AWSProvider([REGION], session=session, endpoint_url=moto_url, image_id=moto_image, sleep=lambda s: None)

    return make


def start(factory, monkeypatch, **kwargs):
    """A daemon on moto (no engine answers there, so probing is left at its own pace)."""
    # The URL its VMs would reach it at (moto boots none; the boot scripts only name it).
    return running_daemon(monkeypatch, probe_interval_s=None, provider_factory=factory,
                          public_url="http://127.0.0.1:9", **kwargs)


def managed(factory) -> list:
    return [i for i in factory("aws").list({TAG_SERVICE: "cloudy"}) if i.status is not InstanceStatus.TERMINATED]


def test_aws_service_launches_tagged_spot_instances_and_adopts_them_after_restart(state_home, aws_factory,
                                                                                  monkeypatch):
    with start(aws_factory, monkeypatch, keep_services=True) as (_, client):
        client.post("/v1/services", json={"yaml": SPEC}).raise_for_status()
        wait_for(lambda: len(managed(aws_factory)) == 2, 60, "2 instances in moto")
        instances = managed(aws_factory)
        assert {i.market.value for i in instances} == {"spot"}
        assert {i.tags[TAG_REPLICA] for i in instances} == {"cloudy-1", "cloudy-2"}
        replicas = client.get("/v1/services/cloudy").json()["replicas"]
        assert {r["state"] for r in replicas} == {"STARTING"}  # no engine answers in moto
        assert {r["instance_id"] for r in replicas} == {i.instance_id for i in instances}

    # A new daemon on the same state finds the same instances and launches nothing new.
    with start(aws_factory, monkeypatch) as (daemon, client):
        wait_for(lambda: client.get("/v1/services/cloudy").status_code == 200, 10, "the service restored")
        wait_for(lambda: daemon.controllers["cloudy"].reconciles >= 3, 60, "three full reconciles")
        after = managed(aws_factory)
        assert {i.instance_id for i in after} == {i.instance_id for i in instances}
        client.delete("/v1/services/cloudy").raise_for_status()
        wait_for(lambda: client.get("/v1/services/cloudy").status_code == 404, 60, "down")
        assert managed(aws_factory) == []
