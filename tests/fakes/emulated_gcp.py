"""A GCP that boots its VMs: a local HTTP fake of the Compute Engine REST API (the JSON shapes the
real google-cloud-compute client sends and reads), plus a machine (tests/fakes/vm_runner) for every
instance inserted, started from its own `startup-script` metadata item, with a metadata server of
its own (tests/fakes/metadata.GCPInstanceMetadata). Nothing of the product is changed: the daemon
reaches it through SPOT_ORCHESTRATOR_GCP_ENDPOINT, as it would a private Compute endpoint.

What it keeps: instances (with their boot disks, deleted with them: `autoDelete`), firewall rules
and zone operations, including `compute.instances.preempted`. A VM's internal address is a
loopback one (127.21.Z.N: reachable from this host). `preempt` flips the VM's
`instance/preempted` to TRUE, records the preemption operation, and deletes the VM at the
deadline (the spot VMs' termination action here is DELETE).
"""

from __future__ import annotations

import itertools
import re
import threading
import time

from providers.base import TAG_SERVICE
from providers.gcp import label, network_tag
from tests.fakes.booting import BootingCloud
from tests.fakes.clouds import Request
from tests.fakes.metadata import GCPInstanceMetadata
from tests.fakes.vm_runner import VMRunner

PROJECT = "emulated-project"
BASE = f"/compute/v1/projects/{PROJECT}"


def _error(code: int, reason: str, message: str) -> dict:
    return {"error": {"code": code, "message": message, "errors": [{"reason": reason, "message": message}]}}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000-00:00", time.gmtime())


class EmulatedGCP(BootingCloud):
    def __init__(self, runner: VMRunner | None = None):
        super().__init__(runner)
        self.instances: dict[str, dict] = {}  # "ZONE/NAME" -> the instance resource
        self.disks: dict[str, str] = {}  # disk name -> "ZONE/NAME" of the instance it boots
        self.firewalls: dict[str, dict] = {}
        self.operations: dict[str, list[dict]] = {}  # zone -> its operations
        self._ids = itertools.count(5000)
        self._zones: dict[str, int] = {}

    def env(self) -> dict[str, str]:
        """What a daemon (or spotctl) process needs to use this GCP."""
        return {"SPOT_ORCHESTRATOR_GCP_ENDPOINT": self.url, "GOOGLE_CLOUD_PROJECT": PROJECT,
                "SPOT_ORCHESTRATOR_REPLICA_ADDRESS": "private"}

    # ---- the API -----------------------------------------------------------------------------

    def _operation(self, zone: str | None, kind: str, target: str) -> dict:
        scope = f"zones/{zone}" if zone else "global"
        op = {"kind": "compute#operation", "id": str(next(self._ids)), "name": f"operation-{next(self._ids)}",
              "operationType": kind, "status": "DONE", "progress": 100, "insertTime": _now(),
              "targetLink": f"https://compute.googleapis.com{BASE}/{scope}/{target}"}
        if zone:
            op["zone"] = f"https://compute.googleapis.com{BASE}/zones/{zone}"
            self.operations.setdefault(zone, []).append(op)
        return op

    def route(self, req: Request):
        with self._lock:
            path = req.path
            if m := re.fullmatch(rf"{BASE}/zones/([^/]+)/instances", path):
                if req.method == "POST":
                    return self._insert(m.group(1), req.json())
                return 200, {"kind": "compute#instanceList", "items": self._matching(req, m.group(1))}
            if m := re.fullmatch(rf"{BASE}/zones/([^/]+)/instances/([^/]+)", path):
                key = f"{m.group(1)}/{m.group(2)}"
                if key not in self.instances:
                    return 404, _error(404, "notFound", f"The resource 'instances/{m.group(2)}' was not found")
                if req.method == "DELETE":
                    self._delete(key)
                    return 200, self._operation(m.group(1), "delete", f"instances/{m.group(2)}")
                return 200, self.instances[key]
            if path == f"{BASE}/aggregated/instances":
                items: dict[str, dict] = {}
                for key, inst in self.instances.items():
                    zone = key.partition("/")[0]
                    if inst in self._matching(req, zone):
                        items.setdefault(f"zones/{zone}", {"instances": []})["instances"].append(inst)
                return 200, {"kind": "compute#instanceAggregatedList", "items": items}
            if m := re.fullmatch(rf"{BASE}/zones/([^/]+)/operations(?:/([^/]+)(/wait)?)?", path):
                ops = self.operations.get(m.group(1), [])
                if m.group(2):
                    op = next((o for o in ops if o["name"] == m.group(2)), None)
                    return (200, op) if op else (404, _error(404, "notFound", "no such operation"))
                wanted = re.search(r'operationType="([^"]+)"', req.query.get("filter", ""))
                return 200, {"kind": "compute#operationList",
                             "items": [o for o in ops if not wanted or o["operationType"] == wanted.group(1)]}
            if path == f"{BASE}/global/firewalls" and req.method == "POST":
                rule = req.json()
                if rule["name"] in self.firewalls:
                    return 409, _error(409, "alreadyExists", f"The resource 'firewalls/{rule['name']}' already exists")
                self.firewalls[rule["name"]] = rule
                return 200, self._operation(None, "insert", f"firewalls/{rule['name']}")
            if m := re.fullmatch(rf"{BASE}/global/firewalls/([^/]+)", path):
                name = m.group(1)
                if name not in self.firewalls:
                    return 404, _error(404, "notFound", f"The resource 'firewalls/{name}' was not found")
                if req.method == "DELETE":
                    del self.firewalls[name]
                elif req.method in ("PUT", "PATCH"):
                    self.firewalls[name] = {**self.firewalls[name], **req.json()}
                else:
                    return 200, self.firewalls[name]
                return 200, self._operation(None, req.method.lower(), f"firewalls/{name}")
            return 404, _error(404, "notFound", f"no route {req.method} {path}")

    def _matching(self, req: Request, zone: str) -> list[dict]:
        """The zone's instances whose labels match the request's `labels.K = "V"` filter."""
        wanted = dict(re.findall(r'labels\.([a-z0-9_-]+) = "([^"]*)"', req.query.get("filter", "")))
        return [inst for key, inst in self.instances.items() if key.startswith(zone + "/")
                and all(inst.get("labels", {}).get(k) == v for k, v in wanted.items())]

    def _insert(self, zone: str, body: dict):
        key = f"{zone}/{body['name']}"
        if key in self.instances:
            return 409, _error(409, "alreadyExists", f"The resource 'instances/{body['name']}' already exists")
        z = self._zones.setdefault(zone, len(self._zones))
        private_ip = f"127.21.{z}.{len([k for k in self.instances if k.startswith(zone)]) + 10}"
        disk = f"{body['name']}-boot"
        self.instances[key] = dict(
            body, id=str(next(self._ids)), status="RUNNING", creationTimestamp=_now(), zone=zone,
            disks=[{"boot": True, "autoDelete": True, "source": f"zones/{zone}/disks/{disk}"}],
            networkInterfaces=[{"network": "global/networks/default", "networkIP": private_ip, "accessConfigs": [
                {"name": "External NAT", "natIP": f"34.21.{z}.{next(self._ids) % 250}"}]}])
        self.disks[disk] = key
        items = body.get("metadata", {}).get("items", [])
        script = next((i["value"] for i in items if i["key"] == "startup-script"), "")
        self.boot(key, GCPInstanceMetadata(zone, body["name"], private_ip), script, private_ip)
        return 200, self._operation(zone, "insert", f"instances/{body['name']}")

    def _delete(self, key: str) -> None:
        self.instances.pop(key, None)
        for disk in [d for d, owner in self.disks.items() if owner == key]:
            del self.disks[disk]
        self.halt(key)

    # ---- what a test does to it --------------------------------------------------------------

    def preempt(self, instance_id: str, grace_s: float) -> float:
        """A spot preemption: instance/preempted TRUE at the VM's metadata server and the zone's
        preemption operation now, the VM deleted at the deadline."""
        zone, _, name = instance_id.partition("/")
        with self._lock:
            if instance_id in self.metadata:
                self.metadata[instance_id].preempt()
            self._operation(zone, "compute.instances.preempted", f"instances/{name}")
        self.preempted.append(instance_id)

        def stop() -> None:
            with self._lock:
                self._delete(instance_id)

        timer = threading.Timer(grace_s, stop)
        timer.daemon = True
        timer.start()
        return time.time() + grace_s

    def leftovers(self, service: str) -> dict[str, list[str]]:
        """What of the service is still in the cloud: instances, disks and firewall rules (VMs
        get ephemeral addresses only: they go with the VM). All empty once `spotctl down` is done."""
        with self._lock:
            instances = [k for k, i in self.instances.items()
                         if i.get("labels", {}).get(label(TAG_SERVICE)) == label(service)]
            disks = [d for d, owner in self.disks.items() if owner in instances]
            rules = [n for n in self.firewalls if n == network_tag(service)]
        return {"instances": instances, "disks": disks, "firewall_rules": rules}
