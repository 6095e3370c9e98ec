"""An Azure that boots its VMs: a local HTTP fake of Azure Resource Manager (the JSON shapes the real
azure-mgmt-compute client and ARM's generic calls send and read), plus a machine
(tests/fakes/vm_runner) for every VM created, started from its own `customData`, with an IMDS and
Scheduled Events server of its own (tests/fakes/metadata.AzureInstanceMetadata). Nothing of the
product is changed: the daemon reaches it through SPOT_ORCHESTRATOR_AZURE_ENDPOINT.

What it keeps, as Azure would: resource groups, virtual networks, NSGs, application security
groups, and per VM the NIC, public address and OS disk made from its inline network config
(deleted with the VM: `deleteOption: Delete`). A VM whose subnet or NSG does not exist is refused
(`InvalidResourceReference`); an NSG still on a NIC cannot be deleted. A VM's private address is
a loopback one (127.22.R.N). `preempt` posts a `Preempt` scheduled event at the VM's IMDS and
deletes the VM at its NotBefore (eviction policy Delete). Sizes in `fail_sizes` are created
`Failed`, as Azure leaves a VM whose provisioning failed.
"""

from __future__ import annotations

import base64
import itertools
import re
import threading

from providers.azure import network_name
from providers.base import TAG_SERVICE, Market
from providers.catalog.loader import catalog_offers
from tests.fakes.booting import BootingCloud
from tests.fakes.clouds import Request
from tests.fakes.metadata import AzureInstanceMetadata
from tests.fakes.vm_runner import VMRunner

SUBSCRIPTION = "00000000-0000-0000-0000-00000000e0e0"
GROUP = "spot-orchestrator"
_RESOURCE = re.compile(r"/subscriptions/[^/]+/resourcegroups/([^/]+)(?:/providers/microsoft\.(compute|network)"
                       r"/([a-z]+)(?:/([^/]+))?)?", re.IGNORECASE)


def _error(status: int, code: str, message: str):
    return status, {"error": {"code": code, "message": message}}


class EmulatedAzure(BootingCloud):
    def __init__(self, runner: VMRunner | None = None):
        super().__init__(runner)
        self.groups: dict[str, dict] = {}
        # (kind, name) -> resource; kinds: virtualMachines, networkInterfaces, publicIPAddresses,
        # disks, virtualNetworks, networkSecurityGroups, applicationSecurityGroups.
        self.resources: dict[tuple[str, str], dict] = {}
        self.owners: dict[tuple[str, str], str] = {}  # a VM's NIC, address and disk -> its service
        self.fail_sizes: set[str] = set()
        self.created: list[dict] = []  # every VM body PUT, in order
        self._addresses = itertools.count(10)

    def env(self) -> dict[str, str]:
        """What a daemon (or spotctl) process needs to use this Azure."""
        return {"SPOT_ORCHESTRATOR_AZURE_ENDPOINT": self.url, "AZURE_SUBSCRIPTION_ID": SUBSCRIPTION,
                "SPOT_ORCHESTRATOR_AZURE_PRICES_URL": self.url + "/api/retail/prices",
                "SPOT_ORCHESTRATOR_REPLICA_ADDRESS": "private"}

    def retail_prices(self, req: Request):
        """The Retail Prices API's answer for the query's region and sizes, priced from the
        catalog snapshot (one page; Linux meters; spot as "<size> Spot")."""
        query = req.query.get("$filter", "")
        region = (re.search(r"armRegionName eq '([^']+)'", query) or [None, ""])[1]
        sizes = set(re.findall(r"armSkuName eq '([^']+)'", query))
        items = [{"armRegionName": o.location.region, "armSkuName": o.instance_type, "unitOfMeasure": "1 Hour",
                  "retailPrice": o.price_per_hour, "productName": "Virtual Machines NC Series",
                  "skuName": o.instance_type.removeprefix("Standard_") + (" Spot" if o.market is Market.SPOT else "")}
                 for o in catalog_offers("azure") if o.location.region == region and o.instance_type in sizes]
        return 200, {"Items": list({(i["armSkuName"], i["skuName"]): i for i in items}.values()),
                     "NextPageLink": None, "Count": len(items)}

    # ---- ARM -------------------------------------------------------------------------------

    def _id(self, kind: str, name: str) -> str:
        space = "Compute" if kind in ("virtualMachines", "disks") else "Network"
        return (f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{GROUP}/providers/Microsoft.{space}/"
                f"{kind}/{name}")

    def route(self, req: Request):
        if req.path == "/api/retail/prices":  # public: no credentials
            return self.retail_prices(req)
        if not req.headers.get("authorization", "").startswith("Bearer ") or not req.query.get("api-version"):
            return _error(401, "AuthenticationFailed", "a bearer token and an api-version are required")
        m = _RESOURCE.fullmatch(req.path)
        if not m:
            return _error(404, "NotFound", req.path)
        group, _, kind, name = m.groups()
        kind = next((k for k in _KINDS if kind and k.lower() == kind.lower()), kind)
        with self._lock:
            if kind is None:
                if req.method == "PUT":
                    self.groups[group] = {"name": group, "location": req.json()["location"],
                                          "properties": {"provisioningState": "Succeeded"}}
                return (200, self.groups[group]) if group in self.groups else \
                    _error(404, "ResourceGroupNotFound", f"Resource group '{group}' could not be found.")
            if group not in self.groups:
                return _error(404, "ResourceGroupNotFound", f"Resource group '{group}' could not be found.")
            if name is None:
                return 200, {"value": [r for (k, _), r in self.resources.items() if k == kind]}
            if req.method == "PUT":
                return self._create_vm(name, req.json()) if kind == "virtualMachines" else self._put(kind, name, req)
            resource = self.resources.get((kind, name))
            if resource is None:
                return (200, "") if req.method == "DELETE" and kind != "virtualMachines" else \
                    _error(404, "ResourceNotFound", f"The Resource '{kind}/{name}' was not found.")
            if req.method == "DELETE":
                return self._delete(kind, name)
            if kind == "virtualMachines" and req.query.get("$expand") == "instanceView":
                resource = dict(resource, properties=dict(resource["properties"], instanceView={"statuses": [
                    {"code": f"ProvisioningState/{resource['properties']['provisioningState'].lower()}"},
                    {"code": "PowerState/running"}]}))
            return 200, resource

    def _put(self, kind: str, name: str, req: Request):
        body = req.json() or {}
        resource = {**body, "name": name, "id": self._id(kind, name), "type": f"Microsoft.Network/{kind}"}
        resource["properties"] = {**body.get("properties", {}), "provisioningState": "Succeeded"}
        self.resources[(kind, name)] = resource
        return 200, resource

    def _create_vm(self, name: str, body: dict):
        self.created.append(body)
        props = body["properties"]
        nic_config = props["networkProfile"]["networkInterfaceConfigurations"][0]
        ip_config = nic_config["properties"]["ipConfigurations"][0]["properties"]
        subnet = ip_config["subnet"]["id"]
        vnet = subnet.split("/subnets/")[0].rpartition("/")[2]
        nsg = (nic_config["properties"].get("networkSecurityGroup") or {}).get("id", "")
        for kind, ref in (("virtualNetworks", vnet), ("networkSecurityGroups", nsg.rpartition("/")[2])):
            if (kind, ref) not in self.resources:
                return _error(400, "InvalidResourceReference", f"Resource {kind}/{ref} referenced by VM {name} "
                              "was not found.")
        if ("virtualMachines", name) in self.resources:
            return 200, self.resources[("virtualMachines", name)]
        service = (body.get("tags") or {}).get(TAG_SERVICE, "")
        region = sorted({k[1] for k in self.resources if k[0] == "virtualNetworks"}).index(vnet)
        private_ip, public_ip = f"127.22.{region}.{next(self._addresses)}", f"20.22.{region}.{next(self._addresses)}"
        ip_name, nic_name, disk_name = f"{name}-ip", nic_config["name"], f"{name}_OsDisk"
        ip_id, nic_id = self._id("publicIPAddresses", ip_name), self._id("networkInterfaces", nic_name)
        self.resources[("publicIPAddresses", ip_name)] = {"name": ip_name, "id": ip_id,
                                                          "properties": {"ipAddress": public_ip}}
        self.resources[("networkInterfaces", nic_name)] = {"name": nic_name, "id": nic_id, "properties": {
            "networkSecurityGroup": {"id": nsg}, "ipConfigurations": [{"name": "ipconfig1", "properties": {
                "privateIPAddress": private_ip, "subnet": {"id": subnet}, "publicIPAddress": {"id": ip_id}}}]}}
        self.resources[("disks", disk_name)] = {"name": disk_name, "id": self._id("disks", disk_name)}
        for part in (("publicIPAddresses", ip_name), ("networkInterfaces", nic_name), ("disks", disk_name)):
            self.owners[part] = service
        failed = props["hardwareProfile"]["vmSize"] in self.fail_sizes
        vm = {**body, "name": name, "id": self._id("virtualMachines", name),
              "type": "Microsoft.Compute/virtualMachines",
              "properties": {**props, "provisioningState": "Failed" if failed else "Succeeded",
                             "networkProfile": {**props["networkProfile"], "networkInterfaces": [{"id": nic_id}]}}}
        self.resources[("virtualMachines", name)] = vm
        script = base64.b64decode(props.get("osProfile", {}).get("customData") or b"").decode()
        if not failed:
            self.boot(name, AzureInstanceMetadata(name, private_ip), script, private_ip)
        return 200, vm

    def _delete(self, kind: str, name: str):
        if kind == "networkSecurityGroups":
            nsg = self._id(kind, name)
            if any(r["properties"].get("networkSecurityGroup", {}).get("id") == nsg
                   for (k, _), r in self.resources.items() if k == "networkInterfaces"):
                return _error(400, "InUseNetworkSecurityGroupCannotBeDeleted",
                              f"Network security group {nsg} cannot be deleted because it is in use.")
        del self.resources[(kind, name)]
        if kind == "virtualMachines":
            for part in (("networkInterfaces", f"{name}-nic"), ("publicIPAddresses", f"{name}-ip"),
                         ("disks", f"{name}_OsDisk")):
                self.resources.pop(part, None)
                self.owners.pop(part, None)
            self.halt(name)
        return 200, ""

    # ---- what a test does to it --------------------------------------------------------------

    def preempt(self, instance_id: str, grace_s: float) -> float:
        """A spot eviction: a Preempt scheduled event at the VM's IMDS now, the VM deleted (with
        its NIC, address and disk) at the event's NotBefore."""
        with self._lock:
            at = self.metadata[instance_id].preempt(grace_s)
        self.preempted.append(instance_id)

        def evict() -> None:
            with self._lock:
                if ("virtualMachines", instance_id) in self.resources:
                    self._delete("virtualMachines", instance_id)

        timer = threading.Timer(grace_s, evict)
        timer.daemon = True
        timer.start()
        return at

    def leftovers(self, service: str) -> dict[str, list[str]]:
        """What of the service is still in the cloud: VMs, NICs, public addresses, disks, NSGs and
        application security groups. All empty once `spotctl down` is done."""
        with self._lock:
            vms = [n for (k, n), r in self.resources.items()
                   if k == "virtualMachines" and (r.get("tags") or {}).get(TAG_SERVICE) == service]
            parts = {kind: [n for (k, n), owner in self.owners.items() if k == kind and owner == service]
                     for kind in ("networkInterfaces", "publicIPAddresses", "disks")}
            security = [f"{k}/{n}" for (k, n) in self.resources
                        if k in ("networkSecurityGroups", "applicationSecurityGroups")
                        and n.startswith(network_name(service, ""))]
        return {"vms": vms, "network_interfaces": parts["networkInterfaces"],
                "addresses": parts["publicIPAddresses"], "disks": parts["disks"], "security": security}


_KINDS = ("virtualMachines", "networkInterfaces", "publicIPAddresses", "disks", "virtualNetworks",
          "networkSecurityGroups", "applicationSecurityGroups")
