"""The daemon on `cloud: aws`: real boto3 against moto's server. Spot instances are launched
through the SDK, tagged with service and replica id, found again by tag after a daemon
restart (no duplicate launch), and terminated by `down`."""

from __future__ import annotations

import boto3
import httpx
import pytest
from moto.server import ThreadedMotoServer

from orchestrator.daemon import Daemon, DaemonServer
from orchestrator.state import Store
from providers.aws import AWSProvider
from providers.base import TAG_REPLICA, TAG_SERVICE, InstanceStatus
from tests.helpers import free_port
from tests.test_daemon import wait_for

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


@pytest.fixture(scope="module")
def moto_url():
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def aws_factory(moto_url):
    session = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)
    image = session.client("ec2", endpoint_url=moto_url).describe_images(Owners=["amazon"])["Images"][0]["ImageId"]

    def make(cloud: str):
        assert cloud == "aws"
        return AWSProvider([REGION], session=session, endpoint_url=moto_url, image_id=image, sleep=lambda s: None)

    return make


def start(factory, monkeypatch):
    monkeypatch.setattr("orchestrator.daemon.RECONCILE_INTERVAL_S", 0.5)
    daemon = Daemon(store=Store(), provider_factory=factory)
    server = DaemonServer(daemon, "127.0.0.1", 0)
    server.start_in_thread()
    client = httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}, timeout=30)
    return server, client


def managed(factory) -> list:
    return [i for i in factory("aws").list({TAG_SERVICE: "cloudy"}) if i.status is not InstanceStatus.TERMINATED]


def test_aws_service_launches_tagged_spot_instances_and_adopts_them_after_restart(state_home, aws_factory,
                                                                                  monkeypatch):
    server, client = start(aws_factory, monkeypatch)
    try:
        client.post("/v1/services", json={"yaml": SPEC}).raise_for_status()
        wait_for(lambda: len(managed(aws_factory)) == 2, 60, "2 instances in moto")
        instances = managed(aws_factory)
        assert {i.market.value for i in instances} == {"spot"}
        assert {i.tags[TAG_REPLICA] for i in instances} == {"cloudy-1", "cloudy-2"}
        replicas = client.get("/v1/services/cloudy").json()["replicas"]
        assert {r["state"] for r in replicas} == {"STARTING"}  # no engine answers in moto
        assert {r["instance_id"] for r in replicas} == {i.instance_id for i in instances}
    finally:
        server.stop()

    # A new daemon on the same state finds the same instances and launches nothing new.
    server, client = start(aws_factory, monkeypatch)
    try:
        wait_for(lambda: client.get("/v1/services/cloudy").status_code == 200, 10, "the service restored")
        for _ in range(6):  # several reconciles
            wait_for(lambda: True, 1, "")
        after = managed(aws_factory)
        assert {i.instance_id for i in after} == {i.instance_id for i in instances}
        client.delete("/v1/services/cloudy").raise_for_status()
        wait_for(lambda: client.get("/v1/services/cloudy").status_code == 404, 60, "down")
        assert managed(aws_factory) == []
    finally:
        server.stop()
