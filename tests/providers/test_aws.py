"""AWS provider: real boto3 against moto's server on 127.0.0.1, and botocore Stubber replies
shaped like real ones (moto's spot prices are a constant)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest
from botocore.exceptions import EndpointConnectionError, NoCredentialsError
from botocore.stub import ANY, Stubber
from moto.backends import get_backend
from moto.core import DEFAULT_ACCOUNT_ID

from providers.aws import AWSProvider, map_error, parse_event
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
    QuotaError,
    TransientError,
)
from tests.fakes.clouds import FakePriceList, price_list_product, serving
from tests.fakes.launching import TOKEN, launch_request
from tests.helpers import moto_session

REGION = "us-east-1"


@pytest.fixture
def provider(moto_url, moto_image):
    aws = AWSProvider([REGION], session=moto_session(REGION), endpoint_url=moto_url, image_id=moto_image,
                      sleep=lambda s: None)
    yield aws
    for instance in aws.list():
        aws.terminate(instance.instance_id)


def _request(replica: str, market: Market, service: str = "chat") -> LaunchRequest:
    return launch_request(AWSProvider([REGION]), replica, Location("aws", REGION, "us-east-1a"), market,
                          service=service)


def test_spot_and_on_demand_launch_are_tagged_and_found_by_tag(provider):
    spot = provider.launch(_request("r1", Market.SPOT))
    on_demand = provider.launch(_request("r2", Market.ON_DEMAND))
    assert spot.market is Market.SPOT and on_demand.market is Market.ON_DEMAND
    assert spot.location == Location("aws", REGION, "us-east-1a")
    found = {i.instance_id: i for i in provider.list({TAG_SERVICE: "chat"})}
    assert set(found) == {spot.instance_id, on_demand.instance_id}
    assert found[spot.instance_id].replica_id == "r1" and found[spot.instance_id].market is Market.SPOT
    assert found[on_demand.instance_id].tags[TAG_REPLICA] == "r2"
    assert provider.list({TAG_SERVICE: "other"}) == []
    # A fresh provider (a restarted daemon) finds them again by tag.
    again = AWSProvider([REGION], session=moto_session(REGION), endpoint_url=provider._endpoint_url)
    assert {i.instance_id for i in again.list()} >= set(found)


def test_launch_is_idempotent_per_replica(provider):
    first = provider.launch(_request("r3", Market.SPOT))
    second = provider.launch(_request("r3", Market.SPOT))
    assert first.instance_id == second.instance_id
    assert len(provider.list({TAG_REPLICA: "r3"})) == 1


def test_terminate_and_missing_instance(provider):
    instance = provider.launch(_request("r4", Market.ON_DEMAND))
    assert provider.get(instance.instance_id).status in (InstanceStatus.PENDING, InstanceStatus.RUNNING)
    provider.terminate(instance.instance_id)
    assert provider.get(instance.instance_id) is None
    provider.terminate("i-0123456789abcdef0")  # not an error
    assert provider.get("i-0123456789abcdef0") is None


def test_interruption_through_moto_backend_is_seen(provider):
    instance = provider.launch(_request("r5", Market.SPOT))
    # The cloud takes the instance back: terminate it behind the provider's back.
    get_backend("ec2")[DEFAULT_ACCOUNT_ID][REGION].terminate_instances([instance.instance_id])
    assert provider.get(instance.instance_id) is None
    assert instance.instance_id not in {i.instance_id for i in provider.list({TAG_SERVICE: "chat"})}


def _event(detail_type: str, instance_id: str, when: str) -> str:
    return json.dumps({
        "version": "0", "id": "7e0b8c2a-1111-2222-3333-444455556666", "detail-type": detail_type,
        "source": "aws.ec2", "account": DEFAULT_ACCOUNT_ID, "time": when, "region": REGION,
        "resources": [f"arn:aws:ec2:{REGION}b:instance/{instance_id}"],
        "detail": {"instance-id": instance_id, "instance-action": "terminate"},
    })


def test_eventbridge_messages_on_sqs_become_notices(moto_url):
    sqs = moto_session(REGION).client("sqs", endpoint_url=moto_url)
    queue = sqs.create_queue(QueueName="spot-events")["QueueUrl"]
    sqs.send_message(QueueUrl=queue, MessageBody=_event("EC2 Spot Instance Interruption Warning", "i-1",
                                                        "2026-12-01T10:00:00Z"))
    sqs.send_message(QueueUrl=queue, MessageBody=_event("EC2 Instance Rebalance Recommendation", "i-2",
                                                        "2026-12-01T10:00:05Z"))
    sqs.send_message(QueueUrl=queue, MessageBody="{not json")
    other = {"detail-type": "EC2 Instance State-change Notification", "detail": {"instance-id": "i-3"},
             "time": "2026-12-01T10:00:00Z"}
    sqs.send_message(QueueUrl=queue, MessageBody=json.dumps(other))
    aws = AWSProvider([REGION], session=moto_session(REGION), endpoint_url=moto_url, sqs_queue_url=queue)
    notices = []
    for _ in range(5):  # SQS hands out at most 10 per call, in any order
        notices += aws.notices()
    by_id = {n.instance_id: n for n in notices}
    assert set(by_id) == {"i-1", "i-2"}
    assert by_id["i-1"].kind is NoticeKind.PREEMPT
    assert by_id["i-1"].deadline == dt.datetime(2026, 12, 1, 10, 2, tzinfo=dt.UTC).timestamp()
    assert by_id["i-2"].kind is NoticeKind.REBALANCE
    assert aws.notices() == []  # every message, malformed ones too, was deleted
    assert sqs.receive_message(QueueUrl=queue).get("Messages", []) == []


def test_offers_from_moto_have_both_markets(provider):
    offers = provider.offers("L4", 1)
    assert {o.market for o in offers} == {Market.SPOT, Market.ON_DEMAND}
    assert all(o.instance_type.startswith("g6.") and o.location.region == REGION for o in offers)
    assert all(o.accelerator == "L4" and o.accelerator_count == 1 for o in offers)
    assert {o.location.zone for o in offers} <= {f"{REGION}{z}" for z in "abcdef"}


# ---- Stubber: realistic replies and errors ------------------------------------------------


def _stubbed(sleeps: list[float] | None = None):
    client = moto_session(REGION).client("ec2")
    stub = Stubber(client)
    pricing = moto_session(REGION).client("pricing")  # no pricing:GetProducts: on-demand from the catalog
    denied = Stubber(pricing)
    for _ in range(4):
        denied.add_client_error("get_products", "AccessDeniedException", "not authorized", 400)
    denied.activate()
    aws = AWSProvider([REGION], session=moto_session(REGION), clients={REGION: client}, image_id="ami-12345678",
                      sleep=(sleeps.append if sleeps is not None else lambda s: None), attempts=3,
                      pricing_client=pricing)
    return aws, stub


def _quote(zone: str, itype: str, price: str, minute: int) -> dict:
    return {"AvailabilityZone": zone, "InstanceType": itype, "ProductDescription": "Linux/UNIX",
            "SpotPrice": price, "Timestamp": dt.datetime(2026, 12, 1, 9, minute, tzinfo=dt.UTC)}


def test_spot_price_history_is_paginated_and_latest_wins():
    aws, stub = _stubbed()
    stub.add_response("describe_spot_price_history", {
        "SpotPriceHistory": [_quote("us-east-1a", "p4d.24xlarge", "9.800000", 10),
                             _quote("us-east-1a", "p4d.24xlarge", "9.100000", 40)],
        "NextToken": "page2"}, {"InstanceTypes": ANY, "ProductDescriptions": ["Linux/UNIX"], "StartTime": ANY})
    stub.add_response("describe_spot_price_history", {
        "SpotPriceHistory": [_quote("us-east-1a", "p4d.24xlarge", "9.500000", 20),
                             _quote("us-east-1b", "p4d.24xlarge", "10.250000", 30)],
        "NextToken": ""}, {"InstanceTypes": ANY, "ProductDescriptions": ["Linux/UNIX"], "StartTime": ANY,
                           "NextToken": "page2"})
    with stub:
        offers = aws.offers("A100", 8)
    stub.assert_no_pending_responses()
    spot = {o.location.zone: o for o in offers if o.market is Market.SPOT}
    assert spot["us-east-1a"].price_per_hour == pytest.approx(9.1)  # the 09:40 quote, not page 2's 09:20
    assert spot["us-east-1b"].price_per_hour == pytest.approx(10.25)
    assert spot["us-east-1a"].accelerator == "A100" and spot["us-east-1a"].accelerator_count == 8
    on_demand = [o for o in offers if o.market is Market.ON_DEMAND]
    assert len(on_demand) == 2 and all(o.price_per_hour > spot["us-east-1b"].price_per_hour for o in on_demand)
    assert {o.source for o in on_demand} == {"snapshot"} and {o.source for o in spot.values()} == {"live"}


def test_on_demand_prices_come_from_the_price_list_api():
    """The real boto3 pricing client against a local Price List endpoint (paged, one product a page)."""
    products = [price_list_product("p4d.24xlarge", REGION, 21.957642),
                price_list_product("p4d.24xlarge", "us-east-2", 21.95764),
                price_list_product("p4d.24xlarge", "eu-west-1", 24.59296),
                price_list_product("g5.xlarge", REGION, 1.006)]
    client = moto_session(REGION).client("ec2")
    stub = Stubber(client)
    stub.add_response("describe_spot_price_history", {
        "SpotPriceHistory": [_quote("us-east-1a", "p4d.24xlarge", "8.191500", 5)]})
    with serving(FakePriceList(products)) as fake, stub:
        pricing = moto_session(REGION).client("pricing", endpoint_url=fake.server.url)
        aws = AWSProvider([REGION], session=moto_session(REGION), clients={REGION: client}, pricing_client=pricing,
                          sleep=lambda s: None)
        offers = aws.offers("A100", 8)
    gets = [r.json() for r in fake.server.requests]
    assert len(gets) == 3 and gets[1]["NextToken"] == "1"  # the type's three regions, one page each
    filters = {f["Field"]: f["Value"] for f in gets[0]["Filters"]}
    assert filters["instanceType"] == "p4d.24xlarge" and filters["operatingSystem"] == "Linux"
    assert filters["marketoption"] == "OnDemand" and filters["capacitystatus"] == "Used"
    (od,) = [o for o in offers if o.market is Market.ON_DEMAND]
    assert (od.location.zone, od.price_per_hour, od.source) == ("us-east-1a", pytest.approx(21.957642), "live")


def test_throttling_is_retried_with_backoff():
    sleeps: list[float] = []
    aws, stub = _stubbed(sleeps)
    for _ in range(2):
        stub.add_client_error("describe_spot_price_history", "RequestLimitExceeded", "Request limit exceeded.", 503)
    quote = _quote("us-east-1c", "g5.xlarge", "0.4", 1)
    stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [quote]})
    with stub:
        offers = aws.offers("A10G", 1)
    assert [o.price_per_hour for o in offers if o.market is Market.SPOT] == [0.4]
    assert len(sleeps) == 2 and sleeps[1] > sleeps[0]


def test_throttling_that_persists_raises_transient():
    aws, stub = _stubbed()
    for _ in range(3):
        stub.add_client_error("describe_spot_price_history", "RequestLimitExceeded", "Request limit exceeded.", 503)
    with stub, pytest.raises(TransientError):
        aws.offers("A10G", 1)


@pytest.mark.parametrize(("code", "error"), [
    ("InsufficientInstanceCapacity", CapacityError),
    ("SpotMaxPriceTooLow", CapacityError),
    ("VcpuLimitExceeded", QuotaError),
    ("AuthFailure", AuthError),
])
def test_launch_errors_are_typed(code, error):
    aws, stub = _stubbed()
    stub.add_response("describe_instances", {"Reservations": []})
    stub.add_response("describe_vpcs", {"Vpcs": []})  # no default VPC: no subnet named
    stub.add_response("describe_security_groups", {"SecurityGroups": []})
    stub.add_client_error("run_instances", code, f"{code} in us-east-1a", 400)
    with stub, pytest.raises(error) as info:
        aws.launch(_request("r9", Market.SPOT))
    if error is CapacityError:
        assert info.value.location == Location("aws", REGION, "us-east-1a") and info.value.market is Market.SPOT
    if error is AuthError:
        assert "aws configure" in str(info.value)


def test_launch_into_a_catalog_az_id_uses_the_accounts_az_name(provider):
    ec2 = moto_session(REGION).client("ec2", endpoint_url=provider._endpoint_url)
    zone = ec2.describe_availability_zones()["AvailabilityZones"][1]
    request = dataclasses.replace(_request("r6", Market.SPOT),
                                  location=Location("aws", REGION, zone["ZoneId"]))  # e.g. use1-az6
    instance = provider.launch(request)
    assert instance.location.zone == zone["ZoneName"]


def test_missing_credentials_name_the_fix():
    err = map_error(NoCredentialsError())
    assert isinstance(err, AuthError) and "aws configure" in str(err)
    assert isinstance(map_error(EndpointConnectionError(endpoint_url="https://ec2.x")), TransientError)


def test_parse_event_ignores_garbage():
    assert parse_event("") is None
    assert parse_event(json.dumps({"detail-type": "EC2 Spot Instance Interruption Warning"})) is None
    notice = parse_event(_event("EC2 Spot Instance Interruption Warning", "i-9", "2026-12-01T10:00:00Z"))
    assert notice.instance_id == "i-9" and notice.kind is NoticeKind.PREEMPT


# ---- the launch path: boot script, network, endpoints ---------------------------------------


def test_the_vm_boots_the_rendered_boot_script_without_secrets(provider):
    import base64

    instance = provider.launch(_request("r7", Market.SPOT))
    ec2 = moto_session(REGION).client("ec2", endpoint_url=provider._endpoint_url)
    user_data = ec2.describe_instance_attribute(InstanceId=instance.instance_id, Attribute="userData")
    script = base64.b64decode(user_data["UserData"]["Value"]).decode()
    assert script.startswith("#!/bin/bash") and "orchestrator.replica.main --cloud aws" in script
    assert TOKEN in script and "KV_SECRET" not in script  # a one-time token, never the secret
    tags = {t["Key"]: t["Value"] for t in ec2.describe_tags(
        Filters=[{"Name": "resource-id", "Values": [instance.instance_id]}])["Tags"]}
    assert tags["spot-orchestrator-ports"] == "8000-8471-8472" and tags[TAG_REPLICA] == "r7"


def test_the_service_network_opens_the_replica_ports_to_the_daemon_and_itself_only(provider, monkeypatch):
    from providers.base import ServiceNetwork

    monkeypatch.setenv("SPOT_ORCHESTRATOR_REPLICA_ADDRESS", "private")
    network = ServiceNetwork("netsvc", (8000, 8471, 8472), ("203.0.113.5/32",), (REGION,))
    provider.prepare_network(network)
    provider.prepare_network(network)  # idempotent
    ec2 = moto_session(REGION).client("ec2", endpoint_url=provider._endpoint_url)
    (group,) = ec2.describe_security_groups(Filters=[{"Name": f"tag:{TAG_SERVICE}", "Values": ["netsvc"]}])[
        "SecurityGroups"]
    rules = {(p["FromPort"], tuple(r["CidrIp"] for r in p["IpRanges"]),
              tuple(g["GroupId"] for g in p["UserIdGroupPairs"])) for p in group["IpPermissions"]}
    assert rules == {(port, ("203.0.113.5/32",), (group["GroupId"],)) for port in (8000, 8471, 8472)}
    instance = provider.launch(_request("r8", Market.SPOT, service="netsvc"))
    described = ec2.describe_instances(InstanceIds=[instance.instance_id])["Reservations"][0]["Instances"][0]
    assert [g["GroupId"] for g in described["SecurityGroups"]] == [group["GroupId"]]
    assert described["SubnetId"].startswith("subnet-")
    address = described["PrivateIpAddress"]
    assert instance.endpoint == f"http://{address}:8000" and instance.agent_endpoint == f"http://{address}:8471"
    assert instance.control_endpoint == f"http://{address}:8472"
    provider.terminate(instance.instance_id)
    provider.remove_network("netsvc", [REGION])
    assert ec2.describe_security_groups(Filters=[{"Name": f"tag:{TAG_SERVICE}", "Values": ["netsvc"]}])[
        "SecurityGroups"] == []
    provider.remove_network("netsvc", [REGION])  # gone already: not an error


def test_one_region_that_cannot_be_read_does_not_hide_the_others(provider):
    instance = provider.launch(_request("r10", Market.SPOT, service="regions"))
    broken = AWSProvider([REGION, "me-central-1"], session=moto_session(REGION), endpoint_url="http://127.0.0.1:9",
                         clients={REGION: provider._ec2(REGION)}, sleep=lambda s: None, attempts=1)
    found = broken.list({TAG_SERVICE: "regions"})
    assert [i.instance_id for i in found] == [instance.instance_id]
    assert found.unknown_regions == {"me-central-1"}
