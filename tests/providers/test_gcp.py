"""GCP provider: the real google-cloud-compute (and -billing) REST clients against a local fake
of the Compute Engine API that answers with its real JSON shapes."""

from __future__ import annotations

import datetime as dt
import itertools
import re
import time

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import billing_v1
from google.cloud.billing_v1.services.cloud_catalog.transports.rest import CloudCatalogRestTransport

from providers.catalog import loader
from providers.base import (
    TAG_REPLICA,
    TAG_SERVICE,
    AuthError,
    CapacityError,
    InstanceStatus,
    LaunchRequest,
    Location,
    Market,
    NoticeKind,
    TransientError,
)
from providers.gcp import PREEMPTED_FILTER, GCPProvider, instance_name, label
from tests.fakes.clouds import FakeBillingCatalog, billing_sku, serving
from tests.fakes.launching import launch_request

PROJECT = "proj-1"
BASE = f"/compute/v1/projects/{PROJECT}"
EXHAUSTED_ZONE = "us-central1-f"  # the insert operation fails with ZONE_RESOURCE_POOL_EXHAUSTED
BUSY_ZONE = "us-east1-d"  # the insert call itself answers 503


def _error(code: int, reason: str, message: str) -> dict:
    return {"error": {"code": code, "message": message, "errors": [{"reason": reason, "message": message}]}}


class FakeCompute:
    def __init__(self):
        self.instances: dict[tuple[str, str], dict] = {}
        self.preempted: dict[str, list[dict]] = {}
        self.ids = itertools.count(1000)

    def _op(self, zone: str, kind: str, target: str, status: str = "RUNNING", error: dict | None = None) -> dict:
        op = {"kind": "compute#operation", "id": str(next(self.ids)), "name": f"operation-{next(self.ids)}",
              "zone": f"https://www.googleapis.com{BASE}/zones/{zone}", "operationType": kind,
              "targetLink": f"https://www.googleapis.com{BASE}/zones/{zone}/instances/{target}",
              "status": status, "insertTime": "2026-12-01T09:00:00.000-07:00", "progress": 0}
        if error:
            op["error"] = error
        return op

    def route(self, req):
        path = req.path
        if m := re.fullmatch(rf"{BASE}/zones/([^/]+)/instances", path):
            zone, body = m.group(1), req.json()
            if zone == BUSY_ZONE:
                return 503, _error(503, "backendError", "Internal error. Please try again.")
            if (zone, body["name"]) in self.instances:
                return 409, _error(409, "alreadyExists", f"The resource '{body['name']}' already exists")
            if zone == EXHAUSTED_ZONE:
                return 200, self._op(zone, "insert", body["name"], "DONE", {"errors": [{
                    "code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                    "message": f"The zone 'projects/{PROJECT}/zones/{zone}' does not have enough resources "
                               "available to fulfill the request."}]})
            self.instances[(zone, body["name"])] = dict(
                body, id=str(next(self.ids)), status="RUNNING", creationTimestamp="2026-12-01T09:00:00.000-07:00",
                networkInterfaces=[{"networkIP": "10.128.0.7", "accessConfigs": [{"natIP": "34.1.2.3"}]}])
            return 200, self._op(zone, "insert", body["name"])
        if m := re.fullmatch(rf"{BASE}/zones/([^/]+)/operations/([^/]+)/wait", path):
            return 200, dict(self._op(m.group(1), "insert", "x", "DONE"), name=m.group(2))
        if m := re.fullmatch(rf"{BASE}/zones/([^/]+)/instances/([^/]+)", path):
            key = (m.group(1), m.group(2))
            if key not in self.instances:
                return 404, _error(404, "notFound", f"The resource 'instances/{key[1]}' was not found")
            if req.method == "DELETE":
                del self.instances[key]
                return 200, self._op(key[0], "delete", key[1])
            return 200, self.instances[key]
        if path == f"{BASE}/aggregated/instances":
            wanted = dict(re.findall(r'labels\.([a-z0-9_-]+) = "([^"]*)"', req.query.get("filter", "")))
            items: dict[str, dict] = {}
            for (zone, _), inst in self.instances.items():
                if all(inst.get("labels", {}).get(k) == v for k, v in wanted.items()):
                    items.setdefault(f"zones/{zone}", {"instances": []})["instances"].append(inst)
            return 200, {"kind": "compute#instanceAggregatedList", "id": f"projects/{PROJECT}/aggregated/instances",
                         "items": items}
        if m := re.fullmatch(rf"{BASE}/zones/([^/]+)/operations", path):
            if req.query.get("filter") != PREEMPTED_FILTER:
                return 400, _error(400, "invalid", "unexpected filter")
            return 200, {"kind": "compute#operationList", "items": self.preempted.get(m.group(1), [])}
        return 404, _error(404, "notFound", f"no route {req.method} {path}")

    def preempt(self, zone: str, name: str, when: str) -> None:
        op = self._op(zone, "compute.instances.preempted", name, "DONE")
        op["insertTime"] = when
        self.preempted.setdefault(zone, []).append(op)
        self.instances.pop((zone, name), None)


@pytest.fixture
def fake():
    with serving(FakeCompute()) as compute:
        yield compute


def _provider(fake, **kw) -> GCPProvider:
    return GCPProvider(PROJECT, host=fake.server.host, url_scheme="http", credentials=AnonymousCredentials(),
                       sleep=lambda s: None, **kw)


def _request(replica: str, zone: str, market: Market = Market.SPOT, itype: str = "a2-highgpu-1g") -> LaunchRequest:
    accelerator = "T4:2" if "+T4x2" in itype else "A100:1"
    return launch_request(GCPProvider(PROJECT), replica, Location("gcp", zone.rsplit("-", 1)[0], zone), market,
                          service="chat-bot", instance_type=itype, accelerator=accelerator)


def test_spot_launch_sends_spot_scheduling_and_sanitized_labels(fake):
    gcp = _provider(fake)
    instance = gcp.launch(_request("R1", "us-central1-a"))
    assert instance.instance_id == "us-central1-a/so-chat-bot-r1"
    assert instance.market is Market.SPOT and instance.status is InstanceStatus.RUNNING
    assert instance.endpoint == "http://34.1.2.3:8000"
    body = fake.instances[("us-central1-a", "so-chat-bot-r1")]
    assert body["scheduling"] == {"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE",
                                  "onHostMaintenance": "TERMINATE", "automaticRestart": False}
    assert body["machineType"] == "zones/us-central1-a/machineTypes/a2-highgpu-1g"
    assert body["labels"][TAG_SERVICE] == "chat-bot" and body["labels"][TAG_REPLICA] == "r1"
    assert all(re.fullmatch(r"[a-z0-9_-]{1,63}", k) and re.fullmatch(r"[a-z0-9_-]{0,63}", v)
               for k, v in body["labels"].items())
    assert "startup-script" in {i["key"] for i in body["metadata"]["items"]}
    insert = next(r for r in fake.server.requests if r.method == "POST" and r.path.endswith("/instances"))
    assert re.fullmatch(r"[0-9a-f-]{36}", insert.query["requestId"])


def test_on_demand_with_attached_gpus(fake):
    gcp = _provider(fake)
    instance = gcp.launch(_request("r2", "us-central1-b", Market.ON_DEMAND, "n1-standard-8+T4x2"))
    body = fake.instances[("us-central1-b", "so-chat-bot-r2")]
    assert body["machineType"].endswith("/n1-standard-8")
    assert body["guestAccelerators"] == [{"acceleratorType": "zones/us-central1-b/acceleratorTypes/nvidia-tesla-t4",
                                          "acceleratorCount": 2}]
    assert body["scheduling"]["provisioningModel"] == "STANDARD"
    assert instance.market is Market.ON_DEMAND and instance.instance_type == "n1-standard-8+T4x2"


def test_relaunch_is_idempotent_list_and_delete(fake):
    gcp = _provider(fake)
    first = gcp.launch(_request("r3", "us-central1-a"))
    again = gcp.launch(_request("r3", "us-central1-a"))  # 409 alreadyExists -> the same VM
    assert again.instance_id == first.instance_id
    gcp.launch(_request("r4", "europe-west4-a"))
    listed = {i.instance_id for i in gcp.list({TAG_SERVICE: "Chat.Bot"})}
    assert listed == {first.instance_id, "europe-west4-a/so-chat-bot-r4"}
    assert [i.instance_id for i in gcp.list({TAG_REPLICA: "r4"})] == ["europe-west4-a/so-chat-bot-r4"]
    assert gcp.list({TAG_SERVICE: "nobody"}) == []
    gcp.terminate(first.instance_id)
    assert gcp.get(first.instance_id) is None
    gcp.terminate(first.instance_id)  # already gone: not an error


def test_zone_resource_pool_exhausted_is_a_capacity_error(fake):
    gcp = _provider(fake)
    with pytest.raises(CapacityError) as info:
        gcp.launch(_request("r5", EXHAUSTED_ZONE))
    assert info.value.location.zone == EXHAUSTED_ZONE and info.value.market is Market.SPOT
    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in str(info.value)


def test_server_errors_are_retried_then_transient(fake):
    sleeps = []
    gcp = GCPProvider(PROJECT, host=fake.server.host, url_scheme="http", credentials=AnonymousCredentials(),
                      sleep=sleeps.append, attempts=3)
    with pytest.raises(TransientError):
        gcp.launch(_request("r6", BUSY_ZONE))
    assert len(sleeps) == 2
    assert sum(r.path.endswith(f"/zones/{BUSY_ZONE}/instances") for r in fake.server.requests) == 3


def test_preemption_operation_becomes_one_notice(fake):
    preempted_at = dt.datetime(2026, 12, 1, 10, tzinfo=dt.UTC).timestamp()
    clock = [preempted_at - 120]
    gcp = _provider(fake, clock=lambda: clock[0])
    instance = gcp.launch(_request("r7", "us-central1-c"))
    assert gcp.notices() == []
    fake.preempt("us-central1-c", "so-chat-bot-r7", "2026-12-01T10:00:00.000-00:00")
    clock[0] += 60
    notices = gcp.notices()
    assert [(n.instance_id, n.kind) for n in notices] == [(instance.instance_id, NoticeKind.PREEMPT)]
    assert notices[0].deadline == pytest.approx(preempted_at + 30)
    assert gcp.notices() == []  # reported once
    assert gcp.get(instance.instance_id) is None


def test_offers_come_from_the_catalog(fake):
    offers = _provider(fake).offers("A100", 1)
    spot = [o for o in offers if o.market is Market.SPOT]
    assert spot and all(o.instance_type == "a2-highgpu-1g" and o.source == "snapshot" for o in spot)
    on_demand = {(o.location, o.instance_type): o.price_per_hour for o in offers if o.market is Market.ON_DEMAND}
    assert all(o.price_per_hour < on_demand[(o.location, o.instance_type)] for o in spot)


AMERICAS = ["us-central1", "us-east1", "us-west1"]
# Real SKU descriptions and Americas list prices (A2 core 0.031611/h, RAM 0.004237/GiB-h, A100 2.933908/h).
BILLING_SKUS = [
    billing_sku("A2 Instance Core running in Americas", "OnDemand", 0.031611, AMERICAS, "CPU"),
    billing_sku("A2 Instance Ram running in Americas", "OnDemand", 0.004237, AMERICAS, "RAM"),
    billing_sku("Nvidia Tesla A100 GPU running in Americas", "OnDemand", 2.933908, AMERICAS),
    billing_sku("Spot Preemptible A2 Instance Core running in Americas", "Preemptible", 0.0158, AMERICAS, "CPU"),
    billing_sku("Spot Preemptible A2 Instance Ram running in Americas", "Preemptible", 0.0021, AMERICAS, "RAM"),
    billing_sku("Nvidia Tesla A100 GPU attached to Spot Preemptible VMs running in Americas", "Preemptible", 1.2,
                AMERICAS),
    billing_sku("Nvidia Tesla A100 80GB GPU running in Americas", "OnDemand", 9.99, AMERICAS),  # not the A100
    billing_sku("Nvidia Tesla A100 GPU running in Americas (DWS Flex Start)", "OnDemand", 0.5, AMERICAS),
    billing_sku("Commitment v1: A2 Cpu in Americas for 1 Year", "Commit1Yr", 0.01, AMERICAS, "CPU"),
    billing_sku("Nvidia Tesla T4 GPU running in Americas", "OnDemand", 0.4, AMERICAS),
    billing_sku("Nvidia Tesla T4 GPU attached to Spot Preemptible VMs running in Americas", "Preemptible", 0.1,
                AMERICAS),
]


@pytest.fixture
def billing():
    with serving(FakeBillingCatalog(BILLING_SKUS, page_size=3)) as catalog:
        yield billing_v1.CloudCatalogClient(transport=CloudCatalogRestTransport(
            host=catalog.server.host, credentials=AnonymousCredentials(), url_scheme="http"))


def test_billing_catalog_prices_a2_machines_as_core_ram_and_gpu_skus(fake, billing):
    offers = _provider(fake, billing_client=billing, zones=["us-central1-a"]).offers("A100")
    quotes = {(o.instance_type, o.market): o for o in offers}
    od = quotes[("a2-highgpu-1g", Market.ON_DEMAND)]
    assert od.price_per_hour == pytest.approx(12 * 0.031611 + 85 * 0.004237 + 2.933908)  # 3.673385, GCP's list
    assert od.source == "live" and od.observed_at == pytest.approx(time.time(), abs=60)
    assert quotes[("a2-highgpu-1g", Market.SPOT)].price_per_hour == pytest.approx(12 * 0.0158 + 85 * 0.0021 + 1.2)
    assert quotes[("a2-highgpu-8g", Market.ON_DEMAND)].price_per_hour == pytest.approx(
        96 * 0.031611 + 680 * 0.004237 + 8 * 2.933908)
    # A100-80GB machines (a2-ultragpu) have no 80GB Spot SKU here: their spot quote stays the catalog's.
    ultra = [o for o in _provider(fake, billing_client=billing, zones=["us-central1-a"]).offers("A100-80GB")]
    assert {(o.market, o.source) for o in ultra} == {(Market.ON_DEMAND, "live"), (Market.SPOT, "snapshot")}


def test_billing_catalog_prices_attached_gpus_on_the_catalog_host(fake, billing):
    offers = _provider(fake, billing_client=billing, zones=["us-central1-a"]).offers("T4")
    t4 = {(o.instance_type, o.market): o.price_per_hour for o in offers}
    host = loader.host_price("gcp", "n1-highmem-4", "us-central1", "us-central1-a", Market.ON_DEMAND)
    spot_host = loader.host_price("gcp", "n1-highmem-4", "us-central1", "us-central1-a", Market.SPOT)
    assert t4[("n1-highmem-4+T4x1", Market.ON_DEMAND)] == pytest.approx(host + 0.4)
    assert t4[("n1-highmem-4+T4x1", Market.SPOT)] == pytest.approx(spot_host + 0.1)
    host8 = loader.host_price("gcp", "n1-highmem-8", "us-central1", "us-central1-a", Market.SPOT)
    assert t4[("n1-highmem-8+T4x2", Market.SPOT)] == pytest.approx(host8 + 2 * 0.1)


def test_names_and_labels_are_valid():
    assert label("Spot-Orchestrator.Service") == "spot-orchestrator-service"
    name = instance_name(_request("A" * 80, "us-central1-a"))
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name)


def test_missing_credentials_are_an_auth_error_naming_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(AuthError, match="gcloud auth application-default login"):
        GCPProvider(PROJECT).list()
