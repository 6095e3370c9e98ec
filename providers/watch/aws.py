"""AWS: IMDSv2 (a session token, then GET) spot/instance-action and the rebalance recommendation."""

from __future__ import annotations

import logging
import time

import httpx

from providers.watch import REBALANCE, PREEMPT, Keyed, iso, notice

log = logging.getLogger(__name__)

NOTICE_S = 120  # a rebalance recommendation has no deadline; the spot warning is 2 min ahead


class AWSWatcher:
    """IMDSv2: a session token first, then the spot and rebalance documents (404 = nothing)."""

    source = "aws:imds"
    interval = 5.0

    def __init__(self, base_url: str = "http://169.254.169.254", instance_id: str | None = None,
                 token_ttl_s: int = 21600):
        self.base_url = base_url.rstrip("/")
        self.instance_id = instance_id
        self._ttl = token_ttl_s
        self._token: str | None = None
        self._token_expires = 0.0

    def _headers(self, client: httpx.Client) -> dict[str, str]:
        if self._token is None or time.monotonic() > self._token_expires:
            reply = client.put(f"{self.base_url}/latest/api/token",
                               headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self._ttl)})
            reply.raise_for_status()
            self._token = reply.text.strip()
            self._token_expires = time.monotonic() + self._ttl * 0.9
        return {"X-aws-ec2-metadata-token": self._token}

    def _get(self, client: httpx.Client, path: str) -> httpx.Response:
        reply = client.get(f"{self.base_url}/latest/meta-data/{path}", headers=self._headers(client))
        if reply.status_code == 401:  # token expired early: fetch a new one once
            self._token = None
            reply = client.get(f"{self.base_url}/latest/meta-data/{path}", headers=self._headers(client))
        return reply

    def identity(self, client: httpx.Client) -> tuple[str, str]:
        """(instance id, private IPv4 address) of this machine."""
        values = []
        for path in ("instance-id", "local-ipv4"):
            reply = self._get(client, path)
            reply.raise_for_status()
            values.append(reply.text.strip())
        self.instance_id = values[0]
        return values[0], values[1]

    def poll(self, client: httpx.Client) -> list[Keyed]:
        if self.instance_id is None:
            reply = self._get(client, "instance-id")
            reply.raise_for_status()
            self.instance_id = reply.text.strip()
        out = []
        action = self._document(client, "spot/instance-action")
        if action is not None:
            try:
                out.append((f"action:{action['time']}", notice(self.instance_id, PREEMPT, iso(action["time"]),
                                                              f"{self.source}:instance-action:{action['action']}")))
            except (KeyError, TypeError, ValueError):
                log.warning("aws imds: ignoring a malformed instance-action document: %.200s", action)
        rebalance = self._document(client, "events/recommendations/rebalance")
        if rebalance is not None:
            try:
                at = iso(rebalance["noticeTime"])
                out.append((f"rebalance:{rebalance['noticeTime']}",
                            notice(self.instance_id, REBALANCE, at + NOTICE_S, f"{self.source}:rebalance")))
            except (KeyError, TypeError, ValueError):
                log.warning("aws imds: ignoring a malformed rebalance document: %.200s", rebalance)
        return out

    def _document(self, client: httpx.Client, path: str):
        reply = self._get(client, path)
        if reply.status_code == 404:
            return None
        reply.raise_for_status()
        try:
            return reply.json()
        except ValueError:
            log.warning("aws imds: ignoring a non-JSON %s body: %.200s", path, reply.text)
            return None
