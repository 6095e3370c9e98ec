"""GCP through google-cloud-compute: spot GPU VMs, labels, preemption from zone operations.

Instance ids are "ZONE/NAME" (GCP addresses instances by zone and name). Labels must be
lowercase [a-z0-9_-]: tags are sanitized on the way in and matched sanitized on the way out.
Offers come from SkyPilot's catalog (host VM plus GPUs; GCP's list prices change monthly, not
minute by minute). With a Cloud Billing Catalog client they are repriced live: a2/a3/g2 machines
as vCPUs x core SKU + GiB x RAM SKU + GPUs x GPU SKU, n1 hosts with attached GPUs as the catalog's
host price + GPUs x GPU SKU.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable

from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.cloud import compute_v1

from providers.catalog.loader import (
    GCP_ATTACHABLE,
    SOURCE_LIVE,
    Machine,
    catalog_offers,
    host_price,
    machines,
)
from providers.base import (
    TAG_MANAGED,
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

PREEMPTED_FILTER = 'operationType="compute.instances.preempted"'
SPOT_NOTICE_S = 30  # GCP gives spot VMs 30 s between the preemption and the hard stop
DEFAULT_IMAGE = DEFAULT_IMAGES["gcp"]
BILLING_SERVICE = "services/6F81-5844-456A"  # Compute Engine in the Cloud Billing Catalog
# Matched in the error text: HTTP errors and operation errors carry them differently.
_CAPACITY = re.compile(r"ZONE_RESOURCE_POOL_EXHAUSTED|does not have enough resources available")
_QUOTA = re.compile(r"QUOTA_EXCEEDED|quotaExceeded|Quota '[^']+' exceeded")
# Billing SKU descriptions: "A2 Instance Core running in Americas", "Spot Preemptible A2 Instance
# Ram running in ...", "Nvidia Tesla A100 GPU running in ...", "Nvidia L4 GPU attached to Spot
# Preemptible VMs running in ...".
_HOST_SKU = re.compile(r"^(?:Spot Preemptible )?([A-Z]\d) Instance (Core|Ram) running in ")
_GPU_SKU = re.compile(r"^Nvidia (?:Tesla )?(.+?) GPU(?: attached to Spot Preemptible VMs)? running in ")
_GPU_SKU_NAMES = {"A100": "A100", "A100 80GB": "A100-80GB", "H100 80GB": "H100", "L4": "L4", "T4": "T4",
                  "V100": "V100", "P100": "P100", "P4": "P4"}
# Not list prices: commitments, reservations, Dynamic Workload Scheduler (Flex, Calendar) and the like.
_NOT_LIST_PRICE = re.compile(r"commit|reserv|sole tenancy|custom|premium|dws|flex|calendar|defined duration",
                             re.IGNORECASE)
# A Compute Engine API other than Google's (a private endpoint, or an emulator): "http://host:port".
ENDPOINT_ENV = "SPOT_ORCHESTRATOR_GCP_ENDPOINT"
# The project, as the Google SDKs and gcloud name it (read when google.auth finds none).
PROJECT_ENVS = ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT")
_HOW_TO_AUTH = ("configure GCP credentials with `gcloud auth application-default login` "
                "or GOOGLE_APPLICATION_CREDENTIALS")


def map_error(err: Exception, location: Location | None = None, market: Market | None = None) -> ProviderError:
    """The one place GCP errors (HTTP and operation errors alike) become typed errors."""
    if isinstance(err, ProviderError):
        return err
    text = f"gcp: {err}"
    if _CAPACITY.search(text):
        return CapacityError(text, location=location, market=market)
    if _QUOTA.search(text):
        return QuotaError(text)
    if isinstance(err, auth_exc.GoogleAuthError | gexc.Unauthenticated | gexc.PermissionDenied):
        return AuthError(f"{text}; {_HOW_TO_AUTH}")
    if isinstance(err, gexc.NotFound):
        return NotFoundError(text)
    if isinstance(err, gexc.TooManyRequests | gexc.ServerError | gexc.DeadlineExceeded | gexc.RetryError):
        return TransientError(text)
    if isinstance(err, ConnectionError | TimeoutError | OSError):
        return TransientError(text)
    return ProviderError(text)


def _operation_error(op: compute_v1.Operation) -> str | None:
    errors = op.error.errors if op.error else []
    return "; ".join(f"{e.code}: {e.message}" for e in errors) or None


def label(value: str) -> str:
    """A GCP label key or value: lowercase [a-z0-9_-], at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", value.lower())[:63]


def network_tag(service: str) -> str:
    """The network tag (and firewall rule name) of a service's VMs: [a-z]([-a-z0-9]*[a-z0-9])?, <= 63."""
    return label(f"spot-orchestrator-{service}").replace("_", "-")[:63].rstrip("-")


def instance_name(request: LaunchRequest) -> str:
    """A valid, deterministic VM name ([a-z]([-a-z0-9]{0,61}[a-z0-9])?) for the replica."""
    core = re.sub(r"[^a-z0-9-]", "-", request.launch_key.lower()).strip("-")
    return f"so-{core}"[:63].rstrip("-")


def _sku_key(description: str) -> tuple[str, str] | None:
    """("core"|"ram", family) or ("gpu", name) for a Billing SKU that prices GPU machines; else None."""
    if _NOT_LIST_PRICE.search(description):
        return None
    if host := _HOST_SKU.match(description):
        return host.group(2).lower(), host.group(1)
    if (gpu := _GPU_SKU.match(description)) and gpu.group(1) in _GPU_SKU_NAMES:
        return "gpu", _GPU_SKU_NAMES[gpu.group(1)]
    return None


def _parse_time(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp() if text else 0.0


class GCPProvider(Provider):
    name = "gcp"

    @classmethod
    def snapshot_offers(cls, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
        return catalog_offers("gcp", accelerator, count)

    def __init__(self, project: str | None = None, zones: list[str] | None = None, *, credentials=None,
                 host: str | None = None, url_scheme: str = "https", instances_client=None,
                 operations_client=None, billing_client=None,
                 image: str = DEFAULT_IMAGE, network: str = "global/networks/default", disk_size_gb: int = 200,
                 attempts: int = 5, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.time):
        endpoint = os.environ.get(ENDPOINT_ENV, "").strip()
        if host is None and endpoint:
            url_scheme, _, host = endpoint.rstrip("/").rpartition("://")
            url_scheme = url_scheme or "https"
        self._credentials = credentials
        self._project = project or next((os.environ[e] for e in PROJECT_ENVS if os.environ.get(e)), None)
        self._host = host
        self._url_scheme = url_scheme
        self._firewalls = None
        self._instances = instances_client
        self._operations = operations_client
        self._billing = billing_client
        self.zones = zones
        self._image = image
        self._network = network
        self._disk_size_gb = disk_size_gb
        self._attempts = attempts
        self._sleep = sleep
        self._clock = clock
        self._started_at = clock()
        self._watched_zones: set[str] = set(zones or ())
        self._seen_operations: set[str] = set()

    # ---- plumbing ----------------------------------------------------------------------

    def _transport_kwargs(self, transport_cls) -> dict:
        if self._host is None:
            return {"credentials": self._credentials} if self._credentials is not None else {}
        from google.auth.credentials import AnonymousCredentials

        creds = self._credentials or AnonymousCredentials()
        return {"transport": transport_cls(host=self._host, credentials=creds, url_scheme=self._url_scheme)}

    def _instances_client(self):
        if self._instances is None:
            from google.cloud.compute_v1.services.instances.transports.rest import InstancesRestTransport

            kwargs = self._transport_kwargs(InstancesRestTransport)
            self._instances = self._call(lambda: compute_v1.InstancesClient(**kwargs))
        return self._instances

    def _operations_client(self):
        if self._operations is None:
            from google.cloud.compute_v1.services.zone_operations.transports.rest import (
                ZoneOperationsRestTransport,
            )

            self._operations = self._call(
                lambda: compute_v1.ZoneOperationsClient(**self._transport_kwargs(ZoneOperationsRestTransport)))
        return self._operations

    def _firewalls_client(self):
        if self._firewalls is None:
            from google.cloud.compute_v1.services.firewalls.transports.rest import FirewallsRestTransport

            self._firewalls = self._call(
                lambda: compute_v1.FirewallsClient(**self._transport_kwargs(FirewallsRestTransport)))
        return self._firewalls

    @property
    def project(self) -> str:
        if self._project is None:
            import google.auth

            try:
                _, self._project = google.auth.default()
            except auth_exc.DefaultCredentialsError as err:
                raise map_error(err) from err
            if not self._project:
                raise AuthError(f"gcp: no project configured; pass project= or {_HOW_TO_AUTH}")
        return self._project

    def _call(self, fn: Callable, location: Location | None = None, market: Market | None = None):
        return sdk.call(fn, map_error, location, market, attempts=self._attempts, sleep=self._sleep)

    # ---- prices ------------------------------------------------------------------------

    def offers(self, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
        offers = [o for o in catalog_offers("gcp", accelerator, count)
                  if self.zones is None or o.location.zone in self.zones]
        skus = self._billing_prices() if self._billing is not None else {}
        if not skus:
            return offers
        shapes = {(m.instance_type, m.region): m for m in machines("gcp", accelerator, count)}
        now = self._clock()
        out = []
        for offer in offers:
            price = self._live_price(shapes[(offer.instance_type, offer.location.region)], offer, skus)
            out.append(dataclasses.replace(offer, price_per_hour=price, observed_at=now, source=SOURCE_LIVE)
                       if price is not None else offer)
        return out

    @staticmethod
    def _live_price(machine: Machine, offer: Offer, skus: dict[tuple[str, str, str, Market], float]) -> float | None:
        """The machine's hourly price from Billing SKUs; None when a SKU it needs is missing."""
        region, market = offer.location.region, offer.market
        gpu = skus.get(("gpu", machine.accelerator, region, market))
        if gpu is None:
            return None
        if machine.host.startswith("n1-"):  # attached GPUs: the n1 host keeps the catalog's price
            host = host_price("gcp", machine.host, region, offer.location.zone, market)
        else:
            family = machine.host.split("-", 1)[0].upper()  # a2-highgpu-1g -> A2
            core, ram = skus.get(("core", family, region, market)), skus.get(("ram", family, region, market))
            if core is None or ram is None or not machine.vcpus or not machine.memory_gib:
                return None
            host = machine.vcpus * core + machine.memory_gib * ram
        return None if host is None else round(host + machine.count * gpu, 6)

    def _billing_prices(self) -> dict[tuple[str, str, str, Market], float]:
        """Hourly list prices by (kind, name, region, market) from the Cloud Billing Catalog: kind
        "core"/"ram" with a machine family (A2, A3, G2) or "gpu" with a catalog GPU name."""

        def fetch():
            prices = {}
            for sku in self._billing.list_skus(parent=BILLING_SERVICE):
                market = {"OnDemand": Market.ON_DEMAND, "Preemptible": Market.SPOT}.get(sku.category.usage_type)
                key = _sku_key(sku.description)
                if market is None or key is None or not sku.pricing_info:
                    continue
                rates = sku.pricing_info[0].pricing_expression.tiered_rates
                if not rates:
                    continue
                unit = rates[-1].unit_price
                for region in sku.service_regions:
                    prices[(*key, region, market)] = unit.units + unit.nanos / 1e9
            return prices

        try:
            return self._call(fetch)
        except ProviderError as err:  # live prices are a bonus: the catalog still answers
            log.warning("gcp billing catalog: %s; using the catalog's prices", err)
            return {}

    # ---- the service's network -----------------------------------------------------------

    def prepare_network(self, network: ServiceNetwork) -> None:
        """One ingress rule on the VPC network per service (GCP firewall rules are global): the
        replica ports, from the daemon's addresses and from the service's own VMs (its network
        tag), to that tag only."""
        tag = network_tag(network.service)
        rule = compute_v1.Firewall(
            name=tag, network=self._network, direction="INGRESS", priority=1000,
            description=f"spot-orchestrator service {network.service}: replica ports",
            allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=[str(p) for p in network.ports])],
            source_ranges=list(network.allowed_cidrs), source_tags=[tag], target_tags=[tag])
        client = self._firewalls_client()
        try:
            self._call(lambda: client.insert_unary(project=self.project, firewall_resource=rule))
        except ProviderError as err:
            if not isinstance(err.__cause__, gexc.Conflict):
                raise
            # Already there (an earlier `up`): make it say what this `up` asks.
            self._call(lambda: client.update_unary(project=self.project, firewall=tag, firewall_resource=rule))

    def remove_network(self, service: str, regions: Iterable[str] | None = None) -> None:
        client = self._firewalls_client()
        try:
            self._call(lambda: client.delete_unary(project=self.project, firewall=network_tag(service)))
        except NotFoundError:
            pass

    # ---- instances ---------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> Instance:
        zone = request.location.zone
        name = instance_name(request)
        client = self._instances_client()
        resource = self._instance_resource(request, name)
        # requestId makes a retried insert a no-op on GCP's side; it must be a UUID.
        request_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"spot-orchestrator/{request.client_token}"))
        try:
            insert = compute_v1.InsertInstanceRequest(project=self.project, zone=zone, instance_resource=resource,
                                                      request_id=request_id)
            op = self._call(lambda: client.insert_unary(request=insert), request.location, request.market)
        except ProviderError as err:
            if isinstance(err.__cause__, gexc.Conflict):  # already exists: the earlier launch won
                return self._get_or_raise(zone, name)
            raise
        op = self._wait(op, zone)
        failure = _operation_error(op)
        if failure:
            raise map_error(RuntimeError(f"launch {zone}/{name}: {failure}"), request.location, request.market)
        self._watched_zones.add(zone)
        instance = self.get(f"{zone}/{name}")
        if instance is None:  # inserted but not yet readable: report what we asked for
            instance = Instance(f"{zone}/{name}", request.location, request.market, request.instance_type,
                                InstanceStatus.PENDING, tags=dict(resource.labels))
        return instance

    def _wait(self, op: compute_v1.Operation, zone: str, rounds: int = 3) -> compute_v1.Operation:
        """Wait (bounded) for an insert to finish, so capacity errors surface at launch time."""
        ops = self._operations_client()
        for _ in range(rounds):
            if op.status == compute_v1.Operation.Status.DONE:
                break
            op = self._call(lambda op=op: ops.wait(project=self.project, zone=zone, operation=op.name))
        return op

    def _instance_resource(self, request: LaunchRequest, name: str) -> compute_v1.Instance:
        zone = request.location.zone
        machine, _, attached = request.instance_type.partition("+")
        labels = {label(k): label(v) for k, v in sdk.launch_tags(request).items()}
        spot = request.market is Market.SPOT
        scheduling = compute_v1.Scheduling(
            provisioning_model="SPOT" if spot else "STANDARD",
            on_host_maintenance="TERMINATE",  # GPUs cannot live-migrate
            automatic_restart=not spot,
            **({"instance_termination_action": "DELETE"} if spot else {}),
        )
        accelerators = []
        if attached:  # "n1-standard-8+T4x2": GPUs attached to an n1 host
            gpu, _, n = attached.rpartition("x")
            accelerators.append(compute_v1.AcceleratorConfig(
                accelerator_type=f"zones/{zone}/acceleratorTypes/{GCP_ATTACHABLE.get(gpu, gpu.lower())}",
                accelerator_count=int(n)))
        return compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{machine}",
            labels=labels,
            tags=compute_v1.Tags(items=[network_tag(request.service)]),
            scheduling=scheduling,
            guest_accelerators=accelerators,
            disks=[compute_v1.AttachedDisk(
                boot=True, auto_delete=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(source_image=request.image_id or self._image,
                                                                          disk_size_gb=self._disk_size_gb))],
            network_interfaces=[compute_v1.NetworkInterface(network=self._network, access_configs=[
                compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")])],
            metadata=compute_v1.Metadata(items=[compute_v1.Items(key="startup-script",
                                                                 value=sdk.user_data(request))]),
        )

    def _get_or_raise(self, zone: str, name: str) -> Instance:
        instance = self.get(f"{zone}/{name}")
        if instance is None:
            raise ProviderError(f"gcp: {zone}/{name} exists but cannot be read")
        return instance

    def get(self, instance_id: str) -> Instance | None:
        zone, _, name = instance_id.partition("/")
        client = self._instances_client()
        try:
            item = self._call(lambda: client.get(project=self.project, zone=zone, instance=name))
        except NotFoundError:
            return None
        return self._to_instance(item, zone)

    def list(self, tags: dict[str, str] | None = None, regions: Iterable[str] | None = None) -> Instances:
        wanted = {label(k): label(v) for k, v in (tags or {TAG_MANAGED: "true"}).items()}
        query = " AND ".join(f'labels.{k} = "{v}"' for k, v in sorted(wanted.items()))
        client = self._instances_client()

        def fetch():
            request = compute_v1.AggregatedListInstancesRequest(project=self.project, filter=query)
            return [(scope, item) for scope, scoped in client.aggregated_list(request=request)
                    for item in scoped.instances]

        out = []
        for scope, item in self._call(fetch):
            if all(item.labels.get(k) == v for k, v in wanted.items()):  # the filter, checked again
                zone = scope.rpartition("/")[2]
                self._watched_zones.add(zone)
                out.append(self._to_instance(item, zone))
        return Instances(out)

    def terminate(self, instance_id: str) -> None:
        zone, _, name = instance_id.partition("/")
        client = self._instances_client()
        try:
            self._call(lambda: client.delete_unary(project=self.project, zone=zone, instance=name))
        except NotFoundError:
            pass

    def _to_instance(self, item: compute_v1.Instance, zone: str) -> Instance:
        labels = dict(item.labels)
        status = {"PROVISIONING": InstanceStatus.PENDING, "STAGING": InstanceStatus.PENDING,
                  "RUNNING": InstanceStatus.RUNNING, "STOPPING": InstanceStatus.STOPPING,
                  "SUSPENDING": InstanceStatus.STOPPING, "SUSPENDED": InstanceStatus.STOPPING,
                  "REPAIRING": InstanceStatus.STOPPING}.get(item.status, InstanceStatus.TERMINATED)
        host = None
        if item.network_interfaces:
            nic = item.network_interfaces[0]
            public = (nic.access_configs[0].nat_i_p if nic.access_configs else "") or None
            host = sdk.reachable_address(public, nic.network_i_p or None)
        machine = item.machine_type.rpartition("/")[2]
        accelerators = list(item.guest_accelerators)
        if accelerators:  # name it the way offers do, so prices and instances join up
            gpu = accelerators[0].accelerator_type.rpartition("/")[2]
            short = next((k for k, v in GCP_ATTACHABLE.items() if v == gpu), gpu)
            machine = f"{machine}+{short}x{accelerators[0].accelerator_count}"
        region = zone.rsplit("-", 1)[0]
        return Instance(
            instance_id=f"{zone}/{item.name}",
            location=Location("gcp", region, zone),
            market=Market.SPOT if item.scheduling.provisioning_model == "SPOT" else Market.ON_DEMAND,
            instance_type=machine,
            status=status,
            tags=labels,
            endpoint=sdk.endpoint(host, labels),
            launched_at=_parse_time(item.creation_timestamp) or self._clock(),
        )

    def close(self) -> None:
        for client in (self._instances, self._operations, self._billing, self._firewalls):
            transport = getattr(client, "transport", None)
            if transport is not None:
                transport.close()

    # ---- notices -------------------------------------------------------------------------

    def notices(self) -> list[Notice]:
        """Preemptions seen in the zone operations of every zone we have instances in."""
        ops = self._operations_client()
        out = []
        for zone in sorted(self._watched_zones):
            request = compute_v1.ListZoneOperationsRequest(project=self.project, zone=zone, filter=PREEMPTED_FILTER)
            for op in self._call(lambda request=request: list(ops.list(request=request))):
                key = str(op.id or op.name)
                inserted = _parse_time(op.insert_time)
                # Old preemptions (before this provider started watching) are history, not news.
                if key in self._seen_operations or op.operation_type != "compute.instances.preempted" \
                        or inserted < self._started_at - 300:
                    continue
                self._seen_operations.add(key)
                name = op.target_link.rpartition("/")[2]
                out.append(Notice(instance_id=f"{zone}/{name}", kind=NoticeKind.PREEMPT,
                                  deadline=inserted + SPOT_NOTICE_S, source="gcp:compute.instances.preempted"))
        return out

