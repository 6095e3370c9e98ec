"""Azure through azure-mgmt-compute: Spot GPU VMs, tags, and prices from the Retail Prices API.

Instance ids are VM names (all VMs live in one resource group). A VM creates its own NIC and
public IP from `subnet_id` (network_api_version), so azure-mgmt-network is not needed. The
Retail Prices API is public (no credentials): its pages are followed via NextPageLink, and
Windows and Low Priority meters are dropped. azure-core's own retries are off:
`orchestrator.common.retry` is the one backoff. Azure has no control-plane eviction feed; evictions
are seen by the replica's Scheduled Events watcher (orchestrator/replica/watchers.py).
"""

from __future__ import annotations

import base64
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable

import httpx
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.mgmt.compute import ComputeManagementClient
from azure.mgmt.compute import models as m

from providers.catalog.loader import SOURCE_LIVE, accelerator_for, catalog_offers, catalog_regions, gpu_instance_types
from providers.base import (
    TAG_MANAGED,
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
# The Retail Prices API could not be reached at all (no route out, a proxy), as opposed to an answer.
_UNREACHABLE = (httpx.ConnectError, httpx.TimeoutException)

RETAIL_PRICES_URL = "https://prices.azure.com/api/retail/prices"
# ARM other than Azure's public cloud (a sovereign cloud's, or an emulator's): "https://host[:port]".
# A plain-http endpoint is a local one: it gets an anonymous bearer token, not the user's.
ENDPOINT_ENV = "SPOT_ORCHESTRATOR_AZURE_ENDPOINT"
RESOURCE_GROUP_ENV = "SPOT_ORCHESTRATOR_AZURE_RESOURCE_GROUP"
PRICES_URL_ENV = "SPOT_ORCHESTRATOR_AZURE_PRICES_URL"  # the Retail Prices API (a mirror, or an emulator)
VNET_PREFIX = "10.91.0.0/16"  # the address space of the network made per region when none is given
NETWORK_API_VERSION = "2022-11-01"
_CAPACITY = {"SkuNotAvailable", "AllocationFailed", "ZonalAllocationFailed", "OverconstrainedAllocationRequest",
             "OverconstrainedZonalAllocationRequest", "SpotCapacityNotAvailable"}
_QUOTA = {"QuotaExceeded", "OperationNotAllowed", "SkuQuotaExceeded"}
_HOW_TO_AUTH = ("configure Azure credentials with `az login` (or AZURE_CLIENT_ID/AZURE_TENANT_ID/"
                "AZURE_CLIENT_SECRET) and set AZURE_SUBSCRIPTION_ID")


def map_error(err: Exception, location: Location | None = None, market: Market | None = None) -> ProviderError:
    """The one place Azure SDK and Retail Prices errors become typed errors."""
    if isinstance(err, ProviderError):
        return err
    if isinstance(err, ClientAuthenticationError):
        return AuthError(f"azure: {err}; {_HOW_TO_AUTH}")
    if isinstance(err, ResourceNotFoundError):
        return NotFoundError(f"azure: {err.message if hasattr(err, 'message') else err}")
    if isinstance(err, HttpResponseError):
        code = getattr(err.error, "code", None) or ""
        message = f"azure {code}: {getattr(err.error, 'message', None) or err.message}".strip()
        if code in _CAPACITY:
            return CapacityError(message, location=location, market=market)
        if code in _QUOTA:
            return QuotaError(message)
        status = err.status_code or 0
        if status == 429 or status >= 500:
            return TransientError(message)
        if status in (401, 403) or code in ("AuthorizationFailed", "InvalidAuthenticationToken"):
            return AuthError(f"{message}; {_HOW_TO_AUTH}")
        return ProviderError(message)
    if isinstance(err, ServiceRequestError | ServiceResponseError | httpx.TransportError):
        return TransientError(f"azure: {type(err).__name__}: {err}")
    if isinstance(err, httpx.HTTPStatusError):
        status = err.response.status_code
        return TransientError(f"azure prices: HTTP {status}") if status == 429 or status >= 500 \
            else ProviderError(f"azure prices: HTTP {status}")
    return ProviderError(f"azure: {type(err).__name__}: {err}")


def vm_name(request: LaunchRequest) -> str:
    """A valid, deterministic Linux VM name for the replica (letters, digits, hyphens; <= 64)."""
    core = re.sub(r"[^A-Za-z0-9-]", "-", request.launch_key).strip("-")
    return f"so-{core}"[:64].rstrip("-")


def image_reference(image: str) -> dict[str, str]:
    """An image as ARM's imageReference: a URN "publisher:offer:sku:version" or a resource id."""
    parts = image.split(":")
    if len(parts) == 4:
        return dict(zip(("publisher", "offer", "sku", "version"), parts, strict=True))
    if image.startswith("/"):
        return {"id": image}
    raise ProviderError(f"azure: image {image!r}: expected publisher:offer:sku:version or a resource id")


def network_name(service: str, region: str) -> str:
    """The name of a service's NSG and application security group in a region."""
    return f"spot-orchestrator-{service}-{region}"[:80]


class _LocalCredential:
    """A bearer token for a plain-http ARM endpoint on this network (never the user's own)."""

    def get_token(self, *scopes, **kwargs):
        from azure.core.credentials import AccessToken

        return AccessToken("local-endpoint", int(time.time()) + 3600)


class AzureProvider(Provider):
    name = "azure"

    @classmethod
    def snapshot_offers(cls, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
        return catalog_offers("azure", accelerator, count)

    def __init__(self, subscription_id: str | None = None, resource_group: str = "spot-orchestrator",
                 regions: list[str] | None = None, *, credential=None, base_url: str | None = None,
                 compute_client=None, subnet_id: str | None = None, prices_url: str = RETAIL_PRICES_URL,
                 http: httpx.Client | None = None,
                 image: dict[str, str] | None = None, admin_username: str = "azureuser",
                 ssh_public_key: str | None = None, eviction_policy: str = "Delete", launch_wait_s: float = 600.0,
                 attempts: int = 5, sleep: Callable[[float], None] = time.sleep):
        self._regions = list(regions) if regions else None  # None: the catalog's GPU regions, on first use
        self._subscription_id = subscription_id or os.environ.get("AZURE_SUBSCRIPTION_ID")
        self.resource_group = os.environ.get(RESOURCE_GROUP_ENV) or resource_group
        base_url = base_url or os.environ.get(ENDPOINT_ENV, "").strip().rstrip("/") or None
        if credential is None and base_url and base_url.startswith("http://"):
            credential = _LocalCredential()
        self._credential = credential
        self._base_url = base_url
        self._client = compute_client
        self._subnet_id = subnet_id
        self._prices_url = os.environ.get(PRICES_URL_ENV) or prices_url
        self._http = http or httpx.Client(follow_redirects=True)
        self._image = image or image_reference(DEFAULT_IMAGES["azure"])
        self._admin_username = admin_username
        self._ssh_public_key = ssh_public_key
        self._eviction_policy = eviction_policy
        self._launch_wait_s = launch_wait_s
        self._attempts = attempts
        self._sleep = sleep
        # azure-core refuses bearer tokens over plain http; a local fake endpoint is plain http.
        self._kw = {"enforce_https": False} if base_url and base_url.startswith("http://") else {}

    @property
    def regions(self) -> list[str]:
        if self._regions is None:
            self._regions = catalog_regions("azure")
        return self._regions

    # ---- plumbing ----------------------------------------------------------------------

    def _compute(self) -> ComputeManagementClient:
        if self._client is None:
            if not self._subscription_id:
                raise AuthError(f"azure: no subscription id; {_HOW_TO_AUTH}")
            credential = self._credential
            if credential is None:
                from azure.identity import DefaultAzureCredential

                credential = DefaultAzureCredential()
            extra = {"base_url": self._base_url} if self._base_url else {}
            self._client = ComputeManagementClient(credential, self._subscription_id, retry_total=0, **extra)
        return self._client

    def _call(self, fn: Callable, location: Location | None = None, market: Market | None = None):
        return sdk.call(fn, map_error, location, market, attempts=self._attempts, sleep=self._sleep)

    # ---- prices ------------------------------------------------------------------------

    def offers(self, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
        types = gpu_instance_types("azure", accelerator, count)
        if not types:
            return []
        sku_filter = " or ".join(f"armSkuName eq '{t}'" for t in types)
        out = []
        for region in self.regions:
            query = (f"serviceName eq 'Virtual Machines' and priceType eq 'Consumption' "
                     f"and armRegionName eq '{region}' and ({sku_filter})")
            try:
                out.extend(self._region_offers(region, query))
            except TransientError as err:
                # An API that cannot be reached at all (no route out, a proxy): the catalog's
                # prices stand in. A throttled one is raised, so the price book cools it down.
                if not isinstance(err.__cause__, _UNREACHABLE):
                    raise
                log.warning("azure retail prices for %s unreachable: %s; using the catalog's prices", region, err)
                out.extend(o for o in catalog_offers("azure", accelerator, count) if o.location.region == region)
        return out

    def _region_offers(self, region: str, query: str) -> list[Offer]:
        def fetch():
            items, url, params = [], self._prices_url, {"$filter": query}
            while url:
                reply = self._http.get(url, params=params, timeout=30)
                reply.raise_for_status()
                page = reply.json()
                items.extend(page.get("Items", []))
                url, params = page.get("NextPageLink"), None  # the link carries the query
            return items

        now = time.time()
        out = []
        for item in self._call(fetch):
            sku, product, itype = item.get("skuName", ""), item.get("productName", ""), item.get("armSkuName", "")
            gpu = accelerator_for("azure", itype)
            if gpu is None or "Windows" in product or "Low Priority" in sku or item.get("unitOfMeasure") != "1 Hour":
                continue
            market = Market.SPOT if sku.endswith("Spot") else Market.ON_DEMAND
            price = float(item.get("retailPrice") or 0)
            if price <= 0:
                continue
            out.append(Offer(Location("azure", region, region), itype, gpu[0], gpu[1], market, price, now, SOURCE_LIVE))
        return out

    # ---- the service's network -----------------------------------------------------------

    def _group_path(self) -> str:
        if not self._subscription_id:
            raise AuthError(f"azure: no subscription id; {_HOW_TO_AUTH}")
        return f"/subscriptions/{self._subscription_id}/resourceGroups/{self.resource_group}"

    def _network_id(self, kind: str, name: str) -> str:
        return f"{self._group_path()}/providers/Microsoft.Network/{kind}/{name}"

    def _subnet(self, region: str) -> str:
        vnet = self._network_id("virtualNetworks", f"spot-orchestrator-{region}")
        return self._subnet_id or f"{vnet}/subnets/replicas"

    def _arm(self, method: str, path: str, body: dict | None = None, api_version: str = NETWORK_API_VERSION):
        """One ARM call through the compute client's pipeline (auth, no retries of its own); the
        reply's JSON, None for 404 on a GET or DELETE."""
        from azure.core.rest import HttpRequest

        compute = self._compute()
        request = HttpRequest(method, f"{path}?api-version={api_version}", json=body)

        def send():
            reply = compute.send_request(request, **self._kw)
            if reply.status_code == 404 and method in ("GET", "DELETE"):
                return None
            if reply.status_code >= 400:
                raise HttpResponseError(response=reply)
            return reply.json() if reply.content else {}

        return self._call(send)

    def prepare_network(self, network: ServiceNetwork) -> None:
        """Per region: the resource group and a virtual network with one subnet when missing
        (unless subnet_id= names one); an application security group for the service's VMs and
        an NSG on their NICs that admits the replica ports from the daemon's addresses and from
        that group, and nothing else from the virtual network (Azure's default rules admit it all)."""
        regions = sorted(network.regions)
        if not regions:
            return
        self._arm("PUT", self._group_path(), {"location": regions[0]}, api_version="2021-04-01")
        ports = [str(p) for p in network.ports]
        for region in regions:
            vnet = self._subnet(region).rpartition("/subnets/")[0]
            if self._subnet_id is None and self._arm("GET", vnet) is None:
                self._arm("PUT", vnet, {"location": region, "properties": {
                    "addressSpace": {"addressPrefixes": [VNET_PREFIX]},
                    "subnets": [{"name": "replicas", "properties": {"addressPrefix": VNET_PREFIX}}]}})
            name = network_name(network.service, region)
            asg = self._network_id("applicationSecurityGroups", name)
            tags = {TAG_SERVICE: network.service, TAG_MANAGED: "true"}
            self._arm("PUT", asg, {"location": region, "tags": tags})

            def rule(rule_name: str, priority: int, access: str, asg: str = asg, **source) -> dict:
                return {"name": rule_name, "properties": {
                    "protocol": "Tcp", "access": access, "direction": "Inbound", "priority": priority,
                    "sourcePortRange": "*", "destinationPortRanges": ports if access == "Allow" else ["*"],
                    "destinationApplicationSecurityGroups": [{"id": asg}], **source}}

            self._arm("PUT", self._network_id("networkSecurityGroups", name), {
                "location": region, "tags": tags, "properties": {"securityRules": [
                    rule("daemon", 100, "Allow", sourceAddressPrefixes=list(network.allowed_cidrs)),
                    rule("replicas", 110, "Allow", sourceApplicationSecurityGroups=[{"id": asg}]),
                    rule("deny-virtual-network", 4000, "Deny", sourceAddressPrefix="VirtualNetwork")]}})

    def remove_network(self, service: str, regions: Iterable[str] | None = None) -> None:
        for region in sorted(set(regions)) if regions else self.regions:
            name = network_name(service, region)
            for kind in ("networkSecurityGroups", "applicationSecurityGroups"):
                try:
                    self._arm("DELETE", self._network_id(kind, name))
                except ProviderError as err:
                    log.warning("azure %s: deleting %s %s failed: %s", region, kind, name, err)

    # ---- instances ---------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> Instance:
        name = vm_name(request)
        existing = self.get(name)
        if existing is not None:  # PUT is idempotent, but never reconfigure a live replica
            return existing
        vm = self._vm_resource(request, name)
        compute = self._compute()
        poller = self._call(lambda: compute.virtual_machines.begin_create_or_update(
            self.resource_group, name, vm, **self._kw), request.location, request.market)

        def finish():
            poller.wait(self._launch_wait_s)
            return poller.result() if poller.done() else None

        created = self._call(finish, request.location, request.market)
        return self._to_instance(created) if created is not None else (self.get(name) or self._pending(request, name))

    def _pending(self, request: LaunchRequest, name: str) -> Instance:
        return Instance(name, request.location, request.market, request.instance_type, InstanceStatus.PENDING,
                        tags=request.all_tags())

    def _vm_resource(self, request: LaunchRequest, name: str) -> m.VirtualMachine:
        spot = request.market is Market.SPOT
        linux = m.LinuxConfiguration(disable_password_authentication=bool(self._ssh_public_key))
        if self._ssh_public_key:
            linux.ssh = m.SshConfiguration(public_keys=[m.SshPublicKey(
                path=f"/home/{self._admin_username}/.ssh/authorized_keys", key_data=self._ssh_public_key)])
        region = request.location.region
        security = network_name(request.service, region)
        vm = m.VirtualMachine(
            location=region,
            tags=sdk.launch_tags(request),
            hardware_profile=m.HardwareProfile(vm_size=request.instance_type),
            storage_profile=m.StorageProfile(
                image_reference=m.ImageReference(
                    **(image_reference(request.image_id) if request.image_id else self._image)),
                os_disk=m.OSDisk(create_option="FromImage", delete_option="Delete", disk_size_gb=200)),
            os_profile=m.OSProfile(
                computer_name=name, admin_username=self._admin_username,
                # Nobody logs in with it; Azure requires a password when no SSH key is given.
                admin_password=None if self._ssh_public_key else secrets.token_urlsafe(24) + "aA1!",
                linux_configuration=linux,
                custom_data=base64.b64encode(sdk.user_data(request).encode()).decode()),
            network_profile=m.NetworkProfile(
                network_api_version=NETWORK_API_VERSION,
                network_interface_configurations=[m.VirtualMachineNetworkInterfaceConfiguration(
                    name=f"{name}-nic", primary=True, delete_option="Delete",
                    network_security_group=m.SubResource(id=self._network_id("networkSecurityGroups", security)),
                    ip_configurations=[m.VirtualMachineNetworkInterfaceIPConfiguration(
                        name="ipconfig1", subnet=m.SubResource(id=self._subnet(region)),
                        application_security_groups=[m.SubResource(
                            id=self._network_id("applicationSecurityGroups", security))],
                        public_ip_address_configuration=m.VirtualMachinePublicIPAddressConfiguration(
                            name=f"{name}-ip", delete_option="Delete"))])]),
            priority="Spot" if spot else "Regular",
        )
        if spot:
            vm.eviction_policy = self._eviction_policy
            vm.billing_profile = m.BillingProfile(max_price=-1)  # pay up to on-demand; evicted for capacity only
        if request.location.zone != request.location.region:
            vm.zones = [request.location.zone.rpartition("-")[2]]
        return vm

    def get(self, instance_id: str) -> Instance | None:
        compute = self._compute()
        try:
            vm = self._call(lambda: compute.virtual_machines.get(self.resource_group, instance_id,
                                                                expand="instanceView", **self._kw))
        except NotFoundError:
            return None
        return self._observed(vm)

    def _observed(self, vm: m.VirtualMachine) -> Instance:
        """The instance, with its endpoint once it runs; a VM left Failed is deleted (its NIC,
        address and disk go with it: delete_option Delete) and reported terminated."""
        instance = self._to_instance(vm)
        if (vm.provisioning_state or "").lower() == "failed":
            log.warning("azure: VM %s failed to provision; deleting it with its NIC, address and disk", vm.name)
            self.terminate(vm.name)
        elif instance.status is InstanceStatus.RUNNING and sdk.TAG_PORT in instance.tags:
            instance.endpoint = sdk.endpoint(self._address(vm), instance.tags)
        return instance

    def _address(self, vm: m.VirtualMachine) -> str | None:
        """The VM's public IP (else private), read from its NIC through ARM's generic endpoint:
        azure-mgmt-network is not a dependency just for two GETs."""
        nics = vm.network_profile.network_interfaces if vm.network_profile else None
        if not nics:
            return None
        nic = self._arm_get(nics[0].id)
        config = ((nic or {}).get("properties", {}).get("ipConfigurations") or [{}])[0].get("properties", {})
        public_id = (config.get("publicIPAddress") or {}).get("id")
        public = self._arm_get(public_id) if public_id else None
        return sdk.reachable_address((public or {}).get("properties", {}).get("ipAddress"),
                                     config.get("privateIPAddress"))

    def _arm_get(self, resource_id: str) -> dict | None:
        from azure.core.rest import HttpRequest

        compute = self._compute()
        request = HttpRequest("GET", f"{resource_id}?api-version={NETWORK_API_VERSION}")
        try:
            reply = self._call(lambda: compute.send_request(request, **self._kw))
        except ProviderError as err:  # an address is a nicety: the instance is still real
            log.warning("azure: cannot read %s: %s", resource_id, err)
            return None
        return reply.json() if reply.status_code == 200 else None

    def list(self, tags: dict[str, str] | None = None, regions: Iterable[str] | None = None) -> Instances:
        wanted = tags or {TAG_MANAGED: "true"}
        compute = self._compute()
        try:
            vms = self._call(lambda: list(compute.virtual_machines.list(self.resource_group, **self._kw)))
        except NotFoundError:  # no resource group yet: nothing launched
            return Instances()
        mine = [vm for vm in vms if all((vm.tags or {}).get(k) == v for k, v in wanted.items())
                and (regions is None or vm.location in set(regions))]
        return Instances(self._observed(vm) for vm in mine)

    def terminate(self, instance_id: str) -> None:
        compute = self._compute()
        try:
            self._call(lambda: compute.virtual_machines.begin_delete(self.resource_group, instance_id, **self._kw))
        except NotFoundError:
            pass

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._http.close()

    def _to_instance(self, vm: m.VirtualMachine) -> Instance:
        state = (vm.provisioning_state or "").lower()
        power = ""
        if vm.instance_view and vm.instance_view.statuses:
            power = next((s.code.split("/", 1)[1] for s in vm.instance_view.statuses
                          if s.code and s.code.startswith("PowerState/")), "")
        if state in ("creating", "updating") or power in ("starting",):
            status = InstanceStatus.PENDING
        elif state == "deleting" or power in ("stopping", "stopped", "deallocating", "deallocated"):
            status = InstanceStatus.STOPPING
        elif state == "failed":
            status = InstanceStatus.TERMINATED
        else:
            status = InstanceStatus.RUNNING
        region = vm.location or ""
        zone = f"{region}-{vm.zones[0]}" if vm.zones else region
        return Instance(
            instance_id=vm.name,
            location=Location("azure", region, zone),
            market=Market.SPOT if str(vm.priority or "").lower().endswith("spot") else Market.ON_DEMAND,
            instance_type=vm.hardware_profile.vm_size if vm.hardware_profile else "",
            status=status,
            tags=dict(vm.tags or {}),
        )
