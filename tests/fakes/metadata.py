"""Fake metadata services of one VM each, as the clouds serve them inside the machine:
AWS IMDSv2, GCP's metadata server and Azure's IMDS with Scheduled Events. An emulated cloud
serves one per machine (tests/fakes/clouds.serving) and injects a preemption through it: the
replica's own watcher must see it and report it, as on a real VM."""

from __future__ import annotations

import datetime as dt
import email.utils
import secrets
import threading
import time

from tests.fakes.clouds import Request


def _rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class AWSInstanceMetadata:
    """IMDSv2: PUT a token, then GET meta-data with it (401 without)."""

    def __init__(self, instance_id: str, private_ip: str, public_ip: str | None = None):
        self.instance_id, self.private_ip, self.public_ip = instance_id, private_ip, public_ip
        self.instance_action: dict | None = None
        self.rebalance: dict | None = None
        self._tokens: set[str] = set()
        self._lock = threading.Lock()

    def preempt(self, grace_s: float) -> float:
        """The spot interruption warning: the instance goes at the returned time."""
        at = time.time() + grace_s
        self.instance_action = {"action": "terminate", "time": _rfc3339(at)}
        return at

    def route(self, req: Request):
        if req.method == "PUT" and req.path == "/latest/api/token":
            token = secrets.token_urlsafe(16)
            with self._lock:
                self._tokens.add(token)
            return 200, token
        if req.headers.get("x-aws-ec2-metadata-token") not in self._tokens:
            return 401, ""
        documents = {
            "/latest/meta-data/instance-id": self.instance_id,
            "/latest/meta-data/local-ipv4": self.private_ip,
            "/latest/meta-data/public-ipv4": self.public_ip,
            "/latest/meta-data/spot/instance-action": self.instance_action,
            "/latest/meta-data/events/recommendations/rebalance": self.rebalance,
        }
        value = documents.get(req.path)
        return (404, "") if value is None else (200, value)


class GCPInstanceMetadata:
    """computeMetadata/v1 with the Metadata-Flavor header; instance/preempted flips to TRUE."""

    def __init__(self, zone: str, name: str, private_ip: str, project_number: str = "123456789"):
        self.zone, self.name, self.private_ip, self.project_number = zone, name, private_ip, project_number
        self.preempted = False

    def preempt(self) -> None:
        self.preempted = True

    def route(self, req: Request):
        if req.headers.get("metadata-flavor") != "Google":
            return 403, "Missing Metadata-Flavor:Google header."
        base = "/computeMetadata/v1/instance/"
        documents = {
            "zone": f"projects/{self.project_number}/zones/{self.zone}",
            "name": self.name,
            "network-interfaces/0/ip": self.private_ip,
            "preempted": "TRUE" if self.preempted else "FALSE",
            "maintenance-event": "NONE",
        }
        if not req.path.startswith(base) or req.path[len(base):] not in documents:
            return 404, ""
        return 200, documents[req.path[len(base):]]


class AzureInstanceMetadata:
    """IMDS (Metadata: true): the compute name, the private address, and Scheduled Events,
    where a Preempt event waits until the VM acknowledges it or its NotBefore passes."""

    def __init__(self, name: str, private_ip: str):
        self.name, self.private_ip = name, private_ip
        self.events: list[dict] = []
        self.acknowledged: list[str] = []
        self.incarnation = 1

    def preempt(self, grace_s: float) -> float:
        at = time.time() + grace_s
        self.events.append({"EventId": secrets.token_hex(8), "EventType": "Preempt", "ResourceType": "VirtualMachine",
                            "Resources": [self.name], "EventStatus": "Scheduled",
                            "NotBefore": email.utils.formatdate(at, usegmt=True), "Description": "spot eviction",
                            "EventSource": "Platform", "DurationInSeconds": -1})
        self.incarnation += 1
        return at

    def route(self, req: Request):
        if req.headers.get("metadata") != "true":
            return 400, {"error": "Bad request. Required metadata header not specified"}
        documents = {
            "/metadata/instance/compute/name": self.name,
            "/metadata/instance/network/interface/0/ipv4/ipAddress/0/privateIpAddress": self.private_ip,
        }
        if req.path in documents:
            return 200, documents[req.path]
        if req.path == "/metadata/scheduledevents":
            if req.method == "POST":
                self.acknowledged += [r.get("EventId") for r in (req.json() or {}).get("StartRequests", [])]
                return 200, ""
            return 200, {"DocumentIncarnation": self.incarnation, "Events": self.events}
        return 404, ""
