"""GCP: the metadata server's instance/preempted (TRUE about 30 s before the stop) and maintenance-event."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx

from providers.watch import MAINTENANCE, PREEMPT, Keyed, notice

log = logging.getLogger(__name__)

NOTICE_S = 30


class GCPWatcher:
    """GCP metadata: instance/preempted flips to TRUE about 30 s before the hard stop."""

    source = "gcp:metadata"
    interval = 1.0
    HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(self, base_url: str = "http://metadata.google.internal", instance_id: str | None = None,
                 clock: Callable[[], float] = time.time):
        self.base_url = base_url.rstrip("/")
        self.instance_id = instance_id
        self._clock = clock

    def _get(self, client: httpx.Client, path: str) -> str:
        reply = client.get(f"{self.base_url}/computeMetadata/v1/instance/{path}", headers=self.HEADERS)
        reply.raise_for_status()
        return reply.text.strip()

    def identity(self, client: httpx.Client) -> tuple[str, str]:
        """(instance id "ZONE/NAME", the first interface's internal address) of this machine."""
        zone = self._get(client, "zone").rpartition("/")[2]
        self.instance_id = f"{zone}/{self._get(client, 'name')}"
        return self.instance_id, self._get(client, "network-interfaces/0/ip")

    def poll(self, client: httpx.Client) -> list[Keyed]:
        if self.instance_id is None:  # the provider's id: "ZONE/NAME"
            zone = self._get(client, "zone").rpartition("/")[2]
            self.instance_id = f"{zone}/{self._get(client, 'name')}"
        out = []
        preempted = self._get(client, "preempted")
        if preempted == "TRUE":
            out.append(("preempted", notice(self.instance_id, PREEMPT, self._clock() + NOTICE_S,
                                             f"{self.source}:preempted")))
        elif preempted != "FALSE":
            log.warning("gcp metadata: ignoring an unexpected preempted value: %.200s", preempted)
        try:
            event = self._get(client, "maintenance-event")
        except httpx.HTTPStatusError:
            event = "NONE"  # older metadata servers lack it
        if event not in ("NONE", ""):
            out.append((f"maintenance:{event}", notice(self.instance_id, MAINTENANCE,
                                                        self._clock() + 60, f"{self.source}:{event}")))
        return out
