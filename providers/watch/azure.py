"""Azure: Scheduled Events. Preempt (and Terminate) events are acknowledged once the replica is
drained, or just before their NotBefore, never earlier: acknowledging makes Azure go at once."""

from __future__ import annotations

import email.utils
import logging
import time
from collections.abc import Callable

import httpx

from providers.watch import MAINTENANCE, PREEMPT, Keyed, notice

log = logging.getLogger(__name__)

DEFAULT_NOTICE_S = 30


class AzureWatcher:
    """Azure Scheduled Events: Preempt/Terminate -> preempt; Reboot/Redeploy/Freeze -> maintenance."""

    source = "azure:scheduledevents"
    interval = 1.0
    API = "api-version=2020-07-01"
    HEADERS = {"Metadata": "true"}
    KINDS = {"Preempt": PREEMPT, "Terminate": PREEMPT, "Reboot": MAINTENANCE, "Redeploy": MAINTENANCE,
             "Freeze": MAINTENANCE}

    def __init__(self, base_url: str = "http://169.254.169.254", instance_id: str | None = None,
                 drained: Callable[[], bool] | None = None, ack_margin_s: float = 3.0,
                 clock: Callable[[], float] = time.time):
        self.base_url = base_url.rstrip("/")
        self.instance_id = instance_id
        self._drained = drained
        self._ack_margin_s = ack_margin_s
        self._clock = clock
        self._pending_ack: dict[str, float] = {}  # EventId -> deadline
        self.acknowledged: list[str] = []

    @property
    def _url(self) -> str:
        return f"{self.base_url}/metadata/scheduledevents?{self.API}"

    def identity(self, client: httpx.Client) -> tuple[str, str]:
        """(the VM's name, which is the provider's instance id; its private IPv4 address)."""
        values = []
        for path in ("compute/name", "network/interface/0/ipv4/ipAddress/0/privateIpAddress"):
            reply = client.get(f"{self.base_url}/metadata/instance/{path}?api-version=2021-02-01&format=text",
                               headers=self.HEADERS)
            reply.raise_for_status()
            values.append(reply.text.strip())
        self.instance_id = values[0]
        return values[0], values[1]

    def poll(self, client: httpx.Client) -> list[Keyed]:
        if self.instance_id is None:
            reply = client.get(f"{self.base_url}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                               headers=self.HEADERS)
            reply.raise_for_status()
            self.instance_id = reply.text.strip()
        reply = client.get(self._url, headers=self.HEADERS)
        reply.raise_for_status()
        try:
            events = reply.json().get("Events", [])
            if not isinstance(events, list):
                raise TypeError("Events is not a list")
        except (ValueError, TypeError, AttributeError):
            log.warning("azure scheduled events: ignoring a malformed document: %.200s", reply.text)
            return []
        out = []
        for event in events:
            try:
                kind = self.KINDS.get(event["EventType"])
                resources = event.get("Resources") or []
                event_id = event["EventId"]
            except (KeyError, TypeError):
                log.warning("azure scheduled events: ignoring a malformed event: %.200s", event)
                continue
            if kind is None or (resources and self.instance_id not in resources):
                continue
            deadline = self._not_before(event.get("NotBefore"))
            if kind == PREEMPT:
                self._pending_ack.setdefault(event_id, deadline)
            out.append((f"event:{event_id}", notice(self.instance_id, kind, deadline,
                                                     f"{self.source}:{event['EventType']}")))
        self._acknowledge_due(client)
        return out

    def _not_before(self, text: str | None) -> float:
        if not text:
            return self._clock() + DEFAULT_NOTICE_S
        try:
            return email.utils.parsedate_to_datetime(text).timestamp()
        except (TypeError, ValueError):
            return self._clock() + DEFAULT_NOTICE_S

    def _acknowledge_due(self, client: httpx.Client) -> None:
        drained = bool(self._drained and self._drained())
        due = [eid for eid, deadline in self._pending_ack.items()
               if drained or deadline - self._clock() <= self._ack_margin_s]
        if not due:
            return
        reply = client.post(self._url, headers=self.HEADERS, json={"StartRequests": [{"EventId": e} for e in due]})
        if reply.is_success:
            for event_id in due:
                del self._pending_ack[event_id]
                self.acknowledged.append(event_id)
