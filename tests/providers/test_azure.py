"""Azure provider: the real azure-mgmt-compute client and an httpx client against local fakes
of ARM and the Retail Prices API that answer with their real JSON shapes."""

from __future__ import annotations

import re
import time

import pytest
from azure.core.credentials import AccessToken

from providers.azure import AzureProvider, vm_name
from providers.base import (
    TAG_REPLICA,
    TAG_SERVICE,
    AuthError,
    CapacityError,
    InstanceStatus,
    LaunchRequest,
    Location,
    Market,
    QuotaError,
    TransientError,
)
from tests.fakes.launching import launch_request
from tests.fakes.clouds import serve, serving

SUB = "00000000-0000-0000-0000-000000000001"
RG = "spot-rg"
VMS = f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.Compute/virtualMachines"
NETWORK = f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.Network"
SUBNET = f"{NETWORK}/virtualNetworks/v/subnets/s"


class FakeCredential:
    def __init__(self):
        self.calls = 0

    def get_token(self, *scopes, **kwargs):
        self.calls += 1
        return AccessToken("fake-token", int(time.time()) + 3600)


def _arm_error(status: int, code: str, message: str):
    return status, {"error": {"code": code, "message": message}}


class FakeArm:
    """Just enough of Microsoft.Compute/virtualMachines; failures keyed by VM size."""

    def __init__(self):
        self.vms: dict[str, dict] = {}
        self.puts: list[dict] = []

    def network(self, path: str):
        kind, _, name = path.strip("/").partition("/")
        if kind == "networkInterfaces":
            return 200, {"name": name, "properties": {"ipConfigurations": [{"name": "ipconfig1", "properties": {
                "privateIPAddress": "10.0.0.4",
                "publicIPAddress": {"id": f"{NETWORK}/publicIPAddresses/{name.removesuffix('-nic')}-ip"}}}]}}
        if kind == "publicIPAddresses":
            return 200, {"name": name, "properties": {"ipAddress": "20.1.2.3", "publicIPAllocationMethod": "Static"}}
        return _arm_error(404, "ResourceNotFound", path)

    def route(self, req):
        assert req.headers.get("authorization") == "Bearer fake-token"
        assert req.query.get("api-version")
        if req.path == VMS and req.method == "GET":
            return 200, {"value": list(self.vms.values())}
        if req.path.startswith(NETWORK):
            return self.network(req.path.removeprefix(NETWORK))
        match = re.fullmatch(rf"{VMS}/([^/]+)", req.path)
        if not match:
            return _arm_error(404, "NotFound", req.path)
        name = match.group(1)
        if req.method == "PUT":
            body = req.json()
            self.puts.append(body)
            size = body["properties"]["hardwareProfile"]["vmSize"]
            if size == "Standard_NC24ads_A100_v4":
                return _arm_error(409, "SkuNotAvailable", "The requested size for resource is currently not "
                                  "available in location 'eastus' zones '' for subscription.")
            if size == "Standard_ND96isr_H100_v5":
                return _arm_error(409, "QuotaExceeded", "Operation could not be completed as it results in "
                                  "exceeding approved standardNDSH100v5Family Cores quota.")
            if size == "Standard_NC6s_v3":
                return _arm_error(503, "ServiceUnavailable", "try later")
            vm = dict(body, name=name, id=f"{VMS}/{name}", type="Microsoft.Compute/virtualMachines")
            vm["properties"] = dict(body["properties"], provisioningState="Succeeded", vmId="1c0e3f1e-0000")
            nic = {"id": f"{NETWORK}/networkInterfaces/{name}-nic"}  # what Azure made from the NIC config
            vm["properties"]["networkProfile"] = dict(vm["properties"]["networkProfile"], networkInterfaces=[nic])
            self.vms[name] = vm
            return 200, vm
        if name not in self.vms:
            return _arm_error(404, "ResourceNotFound", f"The Resource '{name}' was not found.")
        if req.method == "DELETE":
            del self.vms[name]
            return 200, ""
        vm = dict(self.vms[name])
        if req.query.get("$expand") == "instanceView":
            vm["properties"] = dict(vm["properties"], instanceView={"statuses": [
                {"code": "ProvisioningState/succeeded", "level": "Info"},
                {"code": "PowerState/running", "level": "Info", "displayStatus": "VM running"}]})
        return 200, vm


@pytest.fixture
def arm():
    with serving(FakeArm()) as fake:
        yield fake


def _provider(arm, **kw) -> AzureProvider:
    return AzureProvider(SUB, RG, ["eastus"], credential=FakeCredential(), base_url=arm.server.url,
                         subnet_id=SUBNET, sleep=lambda s: None, **kw)


def _request(replica: str, market: Market = Market.SPOT, size: str = "Standard_NC4as_T4_v3") -> LaunchRequest:
    return launch_request(AzureProvider(SUB, RG, ["eastus"]), replica, Location("azure", "eastus", "eastus"), market,
                          instance_type=size, accelerator="T4:1")


def test_spot_vm_request_shape_and_tags(arm):
    azure = _provider(arm)
    instance = azure.launch(_request("r1"))
    assert instance.instance_id == "so-chat-r1" and instance.market is Market.SPOT
    assert instance.status is InstanceStatus.RUNNING and instance.replica_id == "r1"
    assert azure.get(instance.instance_id).endpoint == "http://20.1.2.3:8000"  # the NIC's public IP
    props = arm.puts[0]["properties"]
    assert props["priority"] == "Spot" and props["evictionPolicy"] == "Delete"
    assert props["billingProfile"] == {"maxPrice": -1}
    assert props["hardwareProfile"] == {"vmSize": "Standard_NC4as_T4_v3"}
    nic = props["networkProfile"]["networkInterfaceConfigurations"][0]
    assert nic["properties"]["ipConfigurations"][0]["properties"]["subnet"] == {"id": SUBNET}
    assert props["osProfile"]["customData"]
    assert arm.puts[0]["tags"][TAG_SERVICE] == "chat" and arm.puts[0]["location"] == "eastus"


def test_on_demand_list_get_delete(arm):
    azure = _provider(arm)
    regular = azure.launch(_request("r2", Market.ON_DEMAND))
    assert arm.puts[-1]["properties"]["priority"] == "Regular" and "billingProfile" not in arm.puts[-1]["properties"]
    azure.launch(_request("r3"))
    assert azure.launch(_request("r3")).instance_id == "so-chat-r3"  # idempotent: no second PUT
    assert len(arm.puts) == 2
    assert {i.instance_id for i in azure.list({TAG_SERVICE: "chat"})} == {"so-chat-r2", "so-chat-r3"}
    assert [i.instance_id for i in azure.list({TAG_REPLICA: "r3"})] == ["so-chat-r3"]
    assert azure.list({TAG_SERVICE: "other"}) == []
    assert azure.get(regular.instance_id).market is Market.ON_DEMAND
    azure.terminate(regular.instance_id)
    assert azure.get(regular.instance_id) is None
    azure.terminate(regular.instance_id)  # already gone: fine


@pytest.mark.parametrize(("size", "error"), [
    ("Standard_NC24ads_A100_v4", CapacityError),
    ("Standard_ND96isr_H100_v5", QuotaError),
    ("Standard_NC6s_v3", TransientError),
])
def test_launch_errors_are_typed(arm, size, error):
    sleeps = []
    azure = AzureProvider(SUB, RG, ["eastus"], credential=FakeCredential(), base_url=arm.server.url,
                          subnet_id=SUBNET, sleep=sleeps.append, attempts=3)
    with pytest.raises(error) as info:
        azure.launch(_request("r4", size=size))
    if error is CapacityError:
        assert "SkuNotAvailable" in str(info.value) and info.value.location.region == "eastus"
    if error is TransientError:
        assert len(sleeps) == 2  # retried by the one backoff helper, not by azure-core


def test_missing_subscription_is_an_auth_error(monkeypatch):
    monkeypatch.delenv("AZURE_SUBSCRIPTION_ID", raising=False)
    with pytest.raises(AuthError, match="az login"):
        AzureProvider(None, RG, ["eastus"]).list()


# ---- Retail Prices API ----------------------------------------------------------------------


def _price(sku: str, arm_sku: str, price: float, product: str, region: str = "eastus") -> dict:
    return {"currencyCode": "USD", "tierMinimumUnits": 0.0, "retailPrice": price, "unitPrice": price,
            "armRegionName": region, "location": "US East", "effectiveStartDate": "2026-11-01T00:00:00Z",
            "meterName": sku, "productName": product, "skuName": sku, "serviceName": "Virtual Machines",
            "armSkuName": arm_sku, "unitOfMeasure": "1 Hour", "type": "Consumption", "isPrimaryMeterRegion": True}


def test_retail_prices_are_paginated_and_filtered():
    series = "Virtual Machines NCasT4_v3 Series"
    pages = {
        "1": {"BillingCurrency": "USD", "Items": [
            _price("NC4as T4 v3", "Standard_NC4as_T4_v3", 0.526, series),
            _price("NC4as T4 v3 Spot", "Standard_NC4as_T4_v3", 0.1578, series),
            _price("NC4as T4 v3 Low Priority", "Standard_NC4as_T4_v3", 0.1052, series),
        ], "Count": 3},
        "2": {"BillingCurrency": "USD", "Items": [
            _price("NC4as T4 v3", "Standard_NC4as_T4_v3", 0.736, series + " Windows"),
            _price("NC4as T4 v3 Spot", "Standard_NC4as_T4_v3", 0.2, series + " Windows"),
            _price("NC64as T4 v3 Spot", "Standard_NC64as_T4_v3", 1.3056, series),
        ], "NextPageLink": None, "Count": 3},
    }

    def route(req):
        if "$skip" in req.query:
            return 200, pages["2"]
        assert "armRegionName eq 'eastus'" in req.query["$filter"]
        assert "priceType eq 'Consumption'" in req.query["$filter"]
        page = dict(pages["1"], NextPageLink=f"{server.url}/api/retail/prices?$filter=x&$skip=100")
        return 200, page

    with serve(route) as server:
        azure = AzureProvider(SUB, RG, ["eastus"], prices_url=f"{server.url}/api/retail/prices")
        offers = azure.offers("T4")
    got = sorted((o.instance_type, o.market.value, o.price_per_hour) for o in offers)
    assert got == [("Standard_NC4as_T4_v3", "on_demand", 0.526), ("Standard_NC4as_T4_v3", "spot", 0.1578),
                   ("Standard_NC64as_T4_v3", "spot", 1.3056)]
    assert all(o.location == Location("azure", "eastus", "eastus") and o.accelerator == "T4" for o in offers)
    assert {o.source for o in offers} == {"live"}
    assert {o.accelerator_count for o in offers if o.instance_type == "Standard_NC64as_T4_v3"} == {4}


def test_retail_prices_throttling_is_retried():
    calls = []

    def route(req):
        calls.append(req)
        if len(calls) < 3:
            return 429, {"error": "Too many requests"}
        return 200, {"Items": [_price("NC4as T4 v3 Spot", "Standard_NC4as_T4_v3", 0.15, "x")], "NextPageLink": None}

    sleeps = []
    with serve(route) as server:
        azure = AzureProvider(SUB, RG, ["eastus"], prices_url=f"{server.url}/p", sleep=sleeps.append)
        offers = azure.offers("T4", 1)
    assert [o.price_per_hour for o in offers] == [0.15] and len(sleeps) == 2


def test_unreachable_retail_prices_fall_back_to_the_catalog_and_throttling_is_raised():
    from tests.helpers import free_port

    closed = f"http://127.0.0.1:{free_port()}/p"  # nothing listens: the API cannot be reached
    offers = AzureProvider(SUB, RG, ["eastus"], prices_url=closed, sleep=lambda s: None, attempts=2).offers("T4", 1)
    assert offers and {o.location.region for o in offers} == {"eastus"}
    assert {o.source for o in offers} != {"live"} and {o.market for o in offers} == {Market.SPOT, Market.ON_DEMAND}
    with serve(lambda req: (429, {"error": "Too many requests"})) as server:
        throttled = AzureProvider(SUB, RG, ["eastus"], prices_url=f"{server.url}/p", sleep=lambda s: None,
                                  attempts=2)
        with pytest.raises(TransientError):
            throttled.offers("T4", 1)


def test_vm_names_are_valid():
    name = vm_name(_request("R_1.x" * 20))
    assert re.fullmatch(r"[A-Za-z0-9-]{1,64}", name) and not name.endswith("-")
