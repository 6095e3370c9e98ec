"""AWS through boto3: spot and on-demand GPU instances, spot prices, EventBridge notices.

Offers: the latest `describe_spot_price_history` quote per AZ and type, and on-demand prices per
region from the AWS Price List API (the SkyPilot catalog's when the Price List cannot be read;
instance types and regions come from that catalog). Launches carry an idempotent ClientToken
and are also de-duplicated by the replica tag, so a retried launch never makes a second VM.
Interruption warnings and rebalance recommendations arrive through an optional SQS queue that
an EventBridge rule feeds. botocore's own retries are off: `orchestrator.common.retry` is the one backoff.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import json
import logging
import re
import time
from collections.abc import Callable, Iterable

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

from providers.catalog.loader import (
    SOURCE_LIVE,
    accelerator_for,
    catalog_offers,
    catalog_regions,
    gpu_instance_types,
)
from providers.base import (
    TAG_INCARNATION,
    TAG_MANAGED,
    TAG_REPLICA,
    TAG_SERVICE,
    AuthError,
    CapacityError,
    Instance,
    Instances,
    InstanceStatus,
    LaunchRequest,
    Location,
    Market,
    NotFoundError,
    Notice,
    NoticeKind,
    Offer,
    Provider,
    ProviderError,
    QuotaError,
    ServiceNetwork,
    TransientError,
)
from providers import sdk
from providers.images import DEFAULT_IMAGES

log = logging.getLogger(__name__)

LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]
SPOT_WARNING = "EC2 Spot Instance Interruption Warning"
REBALANCE = "EC2 Instance Rebalance Recommendation"
DEFAULT_AMI_NAME = DEFAULT_IMAGES["aws"]
SPOT_NOTICE_S = 120  # AWS's interruption warning comes two minutes ahead

_CAPACITY = {"InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientCapacity",
             "SpotMaxPriceTooLow", "InsufficientReservedInstanceCapacity", "Unsupported",
             "capacity-not-available", "InsufficientFreeAddressesInSubnet"}
_QUOTA = {"InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded",
          "SpotInstanceLimitExceeded"}
_TRANSIENT = {"RequestLimitExceeded", "Throttling", "ThrottlingException", "ServiceUnavailable",
              "InternalError", "Unavailable", "RequestTimeout", "IncorrectState",
              "DependencyViolation"}  # a security group whose instances are still going away
_AUTH = {"AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "ExpiredToken",
         "SignatureDoesNotMatch", "OptInRequired", "UnrecognizedClientException", "AccessDenied"}
_NOT_FOUND = {"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"}
# The Price List API answers in us-east-1 (also eu-central-1, ap-south-1) for every region.
PRICING_REGION = "us-east-1"
_PRICE_LIST_FILTERS = {"operatingSystem": "Linux", "tenancy": "Shared", "preInstalledSw": "NA",
                       "capacitystatus": "Used", "licenseModel": "No License required", "marketoption": "OnDemand"}
_HOW_TO_AUTH = "configure AWS credentials with `aws configure`, AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"


def map_error(err: Exception, location: Location | None = None, market: Market | None = None) -> ProviderError:
    """The one place AWS errors become typed errors."""
    if isinstance(err, ProviderError):
        return err
    if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        return AuthError(f"aws: no usable credentials ({err}); {_HOW_TO_AUTH}")
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "")
        message = f"aws {code}: {err.response.get('Error', {}).get('Message', '')}".strip()
        if code in _CAPACITY:
            return CapacityError(message, location=location, market=market)
        if code in _QUOTA:
            return QuotaError(message)
        if code in _TRANSIENT or err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
            return TransientError(message)
        if code in _AUTH:
            return AuthError(f"{message}; {_HOW_TO_AUTH}")
        if code in _NOT_FOUND:
            return NotFoundError(message)
        return ProviderError(message)
    if isinstance(err, BotoCoreError):  # connection errors, timeouts
        return TransientError(f"aws: {err}")
    return ProviderError(f"aws: {type(err).__name__}: {err}")


def _region_of_zone(zone: str) -> str:
    return zone[:-1] if zone and zone[-1].isalpha() else zone


def _parse_time(value) -> float:
    if isinstance(value, dt.datetime):
        return value.timestamp()
    return dt.datetime.fromisoformat(str(value)).timestamp()


class AWSProvider(Provider):
    name = "aws"

    @classmethod
    def snapshot_offers(cls, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
        return catalog_offers("aws", accelerator, count)

    def __init__(self, regions: list[str] | None = None, *, session: boto3.session.Session | None = None,
                 endpoint_url: str | None = None, clients: dict[str, object] | None = None,
                 image_id: str | None = None, sqs_queue_url: str | None = None, sqs_client=None,
                 pricing_client=None, subnet_ids: dict[str, str] | None = None,
                 security_group_ids: list[str] | None = None, key_name: str | None = None,
                 attempts: int = 5, sleep: Callable[[float], None] = time.sleep):
        self._regions = list(regions) if regions else None  # None: the catalog's GPU regions, on first use
        self._pricing = pricing_client
        self._session = session or boto3.session.Session()
        self._endpoint_url = endpoint_url
        self._clients: dict[str, object] = dict(clients or {})
        self._image_id = image_id
        self._sqs_queue_url = sqs_queue_url
        self._sqs = sqs_client
        self._subnet_ids = subnet_ids or {}
        self._security_group_ids = security_group_ids
        self._key_name = key_name
        self._attempts = attempts
        self._sleep = sleep
        self._region_of: dict[str, str] = {}  # instance id -> region, learnt from launch/list
        self._zone_names: dict[str, str] = {}  # AZ id (use1-az1) -> this account's AZ name
        self._subnets: dict[str, str | None] = {}  # "region/zone" -> the default VPC's subnet there
        self._seen_events: set[str] = set()
        # botocore retries off (one backoff helper), and bounded timeouts (no hangs).
        self._config = Config(retries={"total_max_attempts": 1}, connect_timeout=5, read_timeout=30)

    @property
    def regions(self) -> list[str]:
        if self._regions is None:
            self._regions = catalog_regions("aws")
        return self._regions

    # ---- plumbing ----------------------------------------------------------------------

    def _ec2(self, region: str):
        if region not in self._clients:
            self._clients[region] = self._session.client("ec2", region_name=region, endpoint_url=self._endpoint_url,
                                                         config=self._config)
        return self._clients[region]

    def _call(self, fn: Callable, location: Location | None = None, market: Market | None = None):
        return sdk.call(fn, map_error, location, market, attempts=self._attempts, sleep=self._sleep)

    # ---- prices ------------------------------------------------------------------------

    def offers(self, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
        types = gpu_instance_types("aws", accelerator, count)
        if not types:
            return []
        regions = self.regions
        for region in regions:  # boto3 makes clients thread-unsafely; use them from threads
            self._ec2(region)
        on_demand = self._on_demand_prices(types, set(regions), accelerator, count)
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(regions))) as pool:
            per_region = list(pool.map(lambda region: self._region_offers(region, types, on_demand), regions))
        return [offer for offers in per_region for offer in offers]

    def _region_offers(self, region: str, types: list[str],
                       on_demand: dict[tuple[str, str], tuple[float, float, str]]) -> list[Offer]:
        client = self._ec2(region)

        def fetch():
            latest: dict[tuple[str, str], dict] = {}
            pages = client.get_paginator("describe_spot_price_history").paginate(
                InstanceTypes=types, ProductDescriptions=["Linux/UNIX"],
                StartTime=dt.datetime.now(dt.UTC))
            for page in pages:
                for item in page.get("SpotPriceHistory", []):
                    key = (item["AvailabilityZone"], item["InstanceType"])
                    if key not in latest or _parse_time(item["Timestamp"]) > _parse_time(latest[key]["Timestamp"]):
                        latest[key] = item
            return latest

        out = []
        for (zone, itype), item in sorted(self._call(fetch).items()):
            gpu = accelerator_for("aws", itype)
            if gpu is None:
                continue
            location = Location("aws", region, zone)
            out.append(Offer(location, itype, gpu[0], gpu[1], Market.SPOT, float(item["SpotPrice"]),
                             _parse_time(item["Timestamp"]), SOURCE_LIVE))
            if (itype, region) in on_demand:
                price, observed, source = on_demand[(itype, region)]
                out.append(Offer(location, itype, gpu[0], gpu[1], Market.ON_DEMAND, price, observed, source))
        return out

    def _on_demand_prices(self, types: list[str], regions: set[str], accelerator: str | None,
                          count: int | None) -> dict[tuple[str, str], tuple[float, float, str]]:
        """(type, region) -> (price, observed_at, source): the Price List's Linux on-demand price, or
        the catalog's where the Price List cannot be read (no pricing:GetProducts permission, ...)."""
        prices = {(o.instance_type, o.location.region): (o.price_per_hour, o.observed_at, o.source)
                  for o in catalog_offers("aws", accelerator, count) if o.market is Market.ON_DEMAND}
        try:
            live = self._price_list(types)
        except ProviderError as err:
            log.warning("aws price list: %s; on-demand prices from the catalog", err)
            return prices
        now = time.time()
        prices.update({key: (price, now, SOURCE_LIVE) for key, price in live.items() if key[1] in regions})
        return prices

    def _price_list(self, types: list[str]) -> dict[tuple[str, str], float]:
        if self._pricing is None:
            self._pricing = self._session.client("pricing", region_name=PRICING_REGION,
                                                 endpoint_url=self._endpoint_url, config=self._config)
        client = self._pricing

        def fetch(itype: str) -> dict[tuple[str, str], float]:
            filters = [{"Type": "TERM_MATCH", "Field": k, "Value": v}
                       for k, v in {"instanceType": itype, **_PRICE_LIST_FILTERS}.items()]
            found = {}
            pages = client.get_paginator("get_products").paginate(ServiceCode="AmazonEC2", Filters=filters,
                                                                   FormatVersion="aws_v1")
            for page in pages:
                for text in page.get("PriceList", []):
                    parsed = parse_price_list_product(text)
                    if parsed is not None:
                        found[(itype, parsed[0])] = parsed[1]
            return found

        out: dict[tuple[str, str], float] = {}
        for itype in types:
            out.update(self._call(lambda itype=itype: fetch(itype)))
        return out

    # ---- instances ---------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> Instance:
        region = request.location.region
        wanted = {TAG_SERVICE: request.service, TAG_REPLICA: request.replica_id}
        if request.incarnation:  # the same replica id of an earlier `up` is another machine
            wanted[TAG_INCARNATION] = request.incarnation
        existing = [i for i in self.list(wanted, regions=[region]) if i.status is not InstanceStatus.TERMINATED]
        if existing:  # a retried launch after the token expired, or after a daemon restart
            return existing[0]
        tags = sdk.launch_tags(request)
        zone = self._zone_name(region, request.location.zone)
        params = {
            "ImageId": request.image_id or self._image_id or self._default_image(region),
            "InstanceType": request.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": request.client_token,
            "Placement": {"AvailabilityZone": zone},
            "UserData": sdk.user_data(request),
            "TagSpecifications": [{"ResourceType": "instance",
                                   "Tags": [{"Key": k, "Value": v} for k, v in sorted(tags.items())]}],
        }
        if request.market is Market.SPOT:
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
        subnet = self._subnet_ids.get(request.location.zone) or self._subnet(region, zone)
        if subnet:
            params["SubnetId"] = subnet
        groups = self._security_group_ids or [g for g in [self._service_group(region, request.service)] if g]
        if groups:
            params["SecurityGroupIds"] = groups
        if self._key_name:
            params["KeyName"] = self._key_name
        ec2 = self._ec2(region)
        reply = self._call(lambda: ec2.run_instances(**params), request.location, request.market)
        instance = self._to_instance(reply["Instances"][0], region)
        self._region_of[instance.instance_id] = region
        return instance

    # ---- the service's network: default VPC, a security group per service and region ----------

    def _default_vpc(self, region: str) -> str | None:
        ec2 = self._ec2(region)
        vpcs = self._call(lambda: ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}]))["Vpcs"]
        return vpcs[0]["VpcId"] if vpcs else None

    def _subnet(self, region: str, zone: str) -> str | None:
        """The default VPC's subnet in the zone (its default one first); None without a default VPC."""
        key = f"{region}/{zone}"
        if key not in self._subnets:
            vpc = self._default_vpc(region)
            found = None
            if vpc is not None:
                ec2 = self._ec2(region)
                wanted = [{"Name": "vpc-id", "Values": [vpc]}, {"Name": "availability-zone", "Values": [zone]}]
                subnets = self._call(lambda: ec2.describe_subnets(Filters=wanted))["Subnets"]
                subnets.sort(key=lambda s: (not s.get("DefaultForAz"), s["SubnetId"]))
                found = subnets[0]["SubnetId"] if subnets else None
            self._subnets[key] = found
        return self._subnets[key]

    def _service_group(self, region: str, service: str) -> str | None:
        """The id of the service's security group in the region, None when there is none."""
        ec2 = self._ec2(region)
        wanted = [{"Name": f"tag:{TAG_SERVICE}", "Values": [service]},
                  {"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]}]
        groups = self._call(lambda: ec2.describe_security_groups(Filters=wanted))["SecurityGroups"]
        return groups[0]["GroupId"] if groups else None

    def prepare_network(self, network: ServiceNetwork) -> None:
        for region in network.regions:
            ec2 = self._ec2(region)
            group = self._service_group(region, network.service)
            if group is None:
                vpc = self._default_vpc(region)
                if vpc is None:
                    raise ProviderError(f"aws {region}: no default VPC (create one: aws ec2 create-default-vpc)")
                tags = [{"Key": TAG_SERVICE, "Value": network.service}, {"Key": TAG_MANAGED, "Value": "true"}]
                group = self._call(lambda vpc=vpc, tags=tags, ec2=ec2: ec2.create_security_group(
                    GroupName=f"spot-orchestrator-{network.service}", VpcId=vpc,
                    Description=f"spot-orchestrator service {network.service}: replica ports",
                    TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}]))["GroupId"]
            permissions = [{"IpProtocol": "tcp", "FromPort": port, "ToPort": port,
                            "IpRanges": [{"CidrIp": cidr, "Description": "the daemon"}
                                         for cidr in network.allowed_cidrs],
                            "UserIdGroupPairs": [{"GroupId": group, "Description": "the service's replicas"}]}
                           for port in network.ports]
            for permission in permissions:  # one by one: an existing rule must not block the others
                self._call(lambda p=permission, g=group, ec2=ec2: _authorize(ec2, g, p))

    def remove_network(self, service: str, regions: Iterable[str] | None = None) -> None:
        for region in sorted(set(regions)) if regions else self.regions:
            try:
                group = self._service_group(region, service)
            except ProviderError as err:
                log.warning("aws %s: looking for the security group of %s failed: %s", region, service, err)
                continue
            if group is not None:
                ec2 = self._ec2(region)
                try:
                    self._call(lambda g=group, ec2=ec2: ec2.delete_security_group(GroupId=g))
                except NotFoundError:
                    pass

    def _zone_name(self, region: str, zone: str) -> str:
        """An AZ name for run_instances; SkyPilot's catalogs (the offline snapshot) use AZ ids."""
        if not re.fullmatch(r"[a-z]+\d+-az\d+", zone):
            return zone
        if zone not in self._zone_names:
            ec2 = self._ec2(region)
            reply = self._call(lambda: ec2.describe_availability_zones(ZoneIds=[zone]))
            zones = reply.get("AvailabilityZones", [])
            if not zones:
                raise ProviderError(f"aws {region}: no availability zone with id {zone}")
            self._zone_names[zone] = zones[0]["ZoneName"]
        return self._zone_names[zone]

    def _default_image(self, region: str) -> str:
        ec2 = self._ec2(region)
        wanted = [{"Name": "name", "Values": [DEFAULT_AMI_NAME]}]
        reply = self._call(lambda: ec2.describe_images(Owners=["amazon"], Filters=wanted))
        images = sorted(reply.get("Images", []), key=lambda im: im.get("CreationDate", ""))
        if not images:
            raise ProviderError(f"aws {region}: no Deep Learning GPU AMI found; pass image_id=")
        return images[-1]["ImageId"]

    def _regions_to_search(self, instance_id: str) -> list[str]:
        """The instance's region when launch or list has seen it, else every region."""
        return [self._region_of[instance_id]] if instance_id in self._region_of else self.regions

    def get(self, instance_id: str) -> Instance | None:
        for region in self._regions_to_search(instance_id):
            ec2 = self._ec2(region)
            try:
                reply = self._call(lambda ec2=ec2: ec2.describe_instances(InstanceIds=[instance_id]))
            except NotFoundError:
                continue
            for reservation in reply.get("Reservations", []):
                for item in reservation.get("Instances", []):
                    instance = self._to_instance(item, region)
                    # A terminated instance stays listed for an hour; for us it no longer exists.
                    return None if instance.status is InstanceStatus.TERMINATED else instance
        return None

    def list(self, tags: dict[str, str] | None = None, regions: Iterable[str] | None = None) -> Instances:
        wanted = tags or {TAG_MANAGED: "true"}
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in sorted(wanted.items())]
        filters.append({"Name": "instance-state-name", "Values": LIVE_STATES})
        searched = sorted(set(regions)) if regions else self.regions
        out, unknown, errors = [], [], []
        for region in searched:
            ec2 = self._ec2(region)

            def fetch(ec2=ec2):
                pages = ec2.get_paginator("describe_instances").paginate(Filters=filters)
                return [item for page in pages for r in page.get("Reservations", []) for item in r["Instances"]]

            try:
                items = self._call(fetch)
            except ProviderError as err:  # one region (e.g. not opted in) must not hide the others
                log.warning("aws %s: listing instances failed: %s", region, err)
                unknown.append(region)
                errors.append(err)
                continue
            for item in items:
                instance = self._to_instance(item, region)
                self._region_of[instance.instance_id] = region
                out.append(instance)
        if searched and len(unknown) == len(searched) and isinstance(errors[-1], AuthError):
            raise errors[-1]
        return Instances(out, unknown)

    def terminate(self, instance_id: str) -> None:
        for region in self._regions_to_search(instance_id):
            ec2 = self._ec2(region)
            try:
                self._call(lambda ec2=ec2: ec2.terminate_instances(InstanceIds=[instance_id]))
                return
            except NotFoundError:
                continue

    def _to_instance(self, item: dict, region: str) -> Instance:
        tags = {t["Key"]: t["Value"] for t in item.get("Tags", [])}
        state = item.get("State", {}).get("Name", "pending")
        status = {"pending": InstanceStatus.PENDING, "running": InstanceStatus.RUNNING,
                  "stopping": InstanceStatus.STOPPING, "stopped": InstanceStatus.STOPPING,
                  "shutting-down": InstanceStatus.STOPPING}.get(state, InstanceStatus.TERMINATED)
        host = sdk.reachable_address(item.get("PublicIpAddress"), item.get("PrivateIpAddress"))
        engine, agent, control = sdk.endpoints(host, tags)
        zone = item.get("Placement", {}).get("AvailabilityZone", "")
        launched = item.get("LaunchTime")
        return Instance(
            instance_id=item["InstanceId"],
            location=Location("aws", region or _region_of_zone(zone), zone),
            market=Market.SPOT if item.get("InstanceLifecycle") == "spot" else Market.ON_DEMAND,
            instance_type=item.get("InstanceType", ""),
            status=status,
            tags=tags,
            endpoint=engine,
            agent_endpoint=agent,
            control_endpoint=control,
            launched_at=_parse_time(launched) if launched else time.time(),
        )

    # ---- notices -------------------------------------------------------------------------

    def notices(self) -> list[Notice]:
        """Interruption warnings and rebalance recommendations from the EventBridge-fed queue."""
        if not self._sqs_queue_url:
            return []
        if self._sqs is None:
            region = self._sqs_queue_url.split(".")[1] if ".amazonaws.com" in self._sqs_queue_url else self.regions[0]
            self._sqs = self._session.client("sqs", region_name=region, endpoint_url=self._endpoint_url,
                                             config=self._config)
        sqs = self._sqs
        reply = self._call(lambda: sqs.receive_message(QueueUrl=self._sqs_queue_url, MaxNumberOfMessages=10,
                                                       WaitTimeSeconds=0))
        out = []
        for message in reply.get("Messages", []):
            notice = parse_event(message.get("Body", ""))
            event_key = message.get("MessageId", "")
            if notice is not None and event_key not in self._seen_events:
                self._seen_events.add(event_key)
                out.append(notice)
            # Handled or malformed: either way it must not come back forever.
            self._call(lambda m=message: sqs.delete_message(QueueUrl=self._sqs_queue_url,
                                                            ReceiptHandle=m["ReceiptHandle"]))
        return out


def parse_price_list_product(text: str) -> tuple[str, float] | None:
    """One Price List product (a JSON string) -> (regionCode, hourly on-demand USD); None if unusable."""
    try:
        product = json.loads(text)
        region = product["product"]["attributes"]["regionCode"]
        term = next(iter(product["terms"]["OnDemand"].values()))
        dimension = next(iter(term["priceDimensions"].values()))
        price = float(dimension["pricePerUnit"]["USD"])
    except (ValueError, KeyError, TypeError, StopIteration, AttributeError):
        return None
    return (region, price) if price > 0 and dimension.get("unit", "Hrs") == "Hrs" else None


def _authorize(ec2, group: str, permission: dict) -> None:
    try:
        ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=[permission])
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") != "InvalidPermission.Duplicate":
            raise


def parse_event(body: str) -> Notice | None:
    """An EventBridge EC2 event (as SQS delivers it) -> Notice; None for anything else."""
    try:
        event = json.loads(body)
        kind = {SPOT_WARNING: NoticeKind.PREEMPT, REBALANCE: NoticeKind.REBALANCE}.get(event.get("detail-type"))
        instance_id = event["detail"]["instance-id"]
        at = _parse_time(event["time"])
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("aws notices: ignoring a malformed queue message: %.200s", body)
        return None
    if kind is None:
        return None
    # The warning is two minutes ahead; a rebalance recommendation has no deadline of its
    # own, so give it the same horizon (it usually precedes the warning).
    return Notice(instance_id=instance_id, kind=kind, deadline=at + SPOT_NOTICE_S, source=f"aws:{event['detail-type']}")

