"""Replica-side preemption-notice watchers: poll the cloud's metadata server, report to the daemon.

Runs on each replica VM beside vLLM (the agent starts one), so it uses the stdlib and httpx
only and imports nothing from the control plane. Each watcher turns the cloud's own format
into a Notice-shaped dict {instance_id, kind, deadline, source} that is POSTed to the daemon's
`/v1/notices` with the bearer token, once per notice: a notice is only marked reported after
the daemon accepted it, so a failed POST is retried on the next poll.

- AWS: IMDSv2 (PUT a token, then GET) spot/instance-action and events/recommendations/rebalance.
- GCP: metadata instance/preempted (TRUE/FALSE) and instance/maintenance-event.
- Azure: Scheduled Events; Preempt (and Terminate) events are acknowledged once the replica is
  drained, or just before their NotBefore, never earlier: acknowledging makes Azure go at once.

Run one: python -m orchestrator.replica.watchers --cloud aws --api http://daemon:8080 --token-file F
"""

from __future__ import annotations

import argparse
import datetime as dt
import email.utils
import logging
import os
import threading
import time
from collections.abc import Callable

import httpx

log = logging.getLogger(__name__)

NOTICES_PATH = "/v1/notices"
PREEMPT, REBALANCE, MAINTENANCE = "preempt", "rebalance", "maintenance"
AWS_NOTICE_S = 120  # a rebalance recommendation has no deadline; the spot warning is 2 min ahead
GCP_NOTICE_S = 30
AZURE_DEFAULT_NOTICE_S = 30

Keyed = tuple[str, dict]  # (de-duplication key, notice dict)


def _notice(instance_id: str, kind: str, deadline: float, source: str) -> dict:
    return {"instance_id": instance_id, "kind": kind, "deadline": deadline, "source": source}


def _iso(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp()


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

    def poll(self, client: httpx.Client) -> list[Keyed]:
        if self.instance_id is None:
            reply = self._get(client, "instance-id")
            reply.raise_for_status()
            self.instance_id = reply.text.strip()
        out = []
        action = self._document(client, "spot/instance-action")
        if action is not None:
            try:
                out.append((f"action:{action['time']}", _notice(self.instance_id, PREEMPT, _iso(action["time"]),
                                                              f"{self.source}:instance-action:{action['action']}")))
            except (KeyError, TypeError, ValueError):
                log.warning("aws imds: ignoring a malformed instance-action document: %.200s", action)
        rebalance = self._document(client, "events/recommendations/rebalance")
        if rebalance is not None:
            try:
                at = _iso(rebalance["noticeTime"])
                out.append((f"rebalance:{rebalance['noticeTime']}",
                            _notice(self.instance_id, REBALANCE, at + AWS_NOTICE_S, f"{self.source}:rebalance")))
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

    def poll(self, client: httpx.Client) -> list[Keyed]:
        if self.instance_id is None:  # the provider's id: "ZONE/NAME"
            zone = self._get(client, "zone").rpartition("/")[2]
            self.instance_id = f"{zone}/{self._get(client, 'name')}"
        out = []
        preempted = self._get(client, "preempted")
        if preempted == "TRUE":
            out.append(("preempted", _notice(self.instance_id, PREEMPT, self._clock() + GCP_NOTICE_S,
                                             f"{self.source}:preempted")))
        elif preempted != "FALSE":
            log.warning("gcp metadata: ignoring an unexpected preempted value: %.200s", preempted)
        try:
            event = self._get(client, "maintenance-event")
        except httpx.HTTPStatusError:
            event = "NONE"  # older metadata servers lack it
        if event not in ("NONE", ""):
            out.append((f"maintenance:{event}", _notice(self.instance_id, MAINTENANCE,
                                                        self._clock() + 60, f"{self.source}:{event}")))
        return out


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
            out.append((f"event:{event_id}", _notice(self.instance_id, kind, deadline,
                                                     f"{self.source}:{event['EventType']}")))
        self._acknowledge_due(client)
        return out

    def _not_before(self, text: str | None) -> float:
        if not text:
            return self._clock() + AZURE_DEFAULT_NOTICE_S
        try:
            return email.utils.parsedate_to_datetime(text).timestamp()
        except (TypeError, ValueError):
            return self._clock() + AZURE_DEFAULT_NOTICE_S

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


WATCHERS = {"aws": AWSWatcher, "gcp": GCPWatcher, "azure": AzureWatcher}


class NoticeReporter:
    """POSTs notices to the daemon's API with the bearer token; True when accepted."""

    def __init__(self, api_url: str, token: str, client: httpx.Client | None = None, timeout_s: float = 5.0):
        self.url = api_url.rstrip("/") + NOTICES_PATH
        self._headers = {"Authorization": f"Bearer {token}"}
        self._client = client or httpx.Client(timeout=timeout_s)

    def report(self, notice: dict) -> bool:
        try:
            reply = self._client.post(self.url, json=notice, headers=self._headers)
        except httpx.HTTPError as err:
            log.warning("notice for %s not delivered (will retry): %s", notice.get("instance_id"), err)
            return False
        if not reply.is_success:
            log.warning("notice for %s refused: HTTP %s %.200s", notice.get("instance_id"), reply.status_code,
                        reply.text)
        return reply.is_success

    def close(self) -> None:
        self._client.close()


class WatchLoop:
    """Poll a watcher every `interval` seconds; report each notice once."""

    def __init__(self, watcher, reporter: NoticeReporter, interval: float | None = None,
                 client: httpx.Client | None = None):
        self.watcher = watcher
        self.reporter = reporter
        self.interval = watcher.interval if interval is None else interval
        # Metadata servers answer locally: a short timeout keeps one poll inside its interval.
        self._client = client or httpx.Client(timeout=min(2.0, max(0.5, self.interval)))
        self.reported: set[str] = set()
        self.stop_event = threading.Event()

    def step(self) -> list[dict]:
        """One poll; returns the notices newly delivered."""
        try:
            found = self.watcher.poll(self._client)
        except (httpx.HTTPError, ValueError) as err:
            log.warning("%s: poll failed: %s", self.watcher.source, err)
            return []
        delivered = []
        for key, notice in found:
            if key not in self.reported and self.reporter.report(notice):
                self.reported.add(key)
                delivered.append(notice)
        return delivered

    def run(self) -> None:
        while not self.stop_event.is_set():
            started = time.monotonic()
            self.step()
            self.stop_event.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name=f"notice-watcher-{self.watcher.source}", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        self.stop()
        self._client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Watch the cloud's metadata for preemption notices.")
    parser.add_argument("--cloud", required=True, choices=sorted(WATCHERS))
    parser.add_argument("--api", required=True, help="the daemon's base URL")
    parser.add_argument("--token-file", help="file holding the API bearer token (else $SPOT_ORCHESTRATOR_TOKEN)")
    parser.add_argument("--instance-id", help="default: read from the metadata server")
    parser.add_argument("--metadata-url", help="override the metadata server's base URL")
    parser.add_argument("--interval", type=float, help="poll interval in seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.token_file:
        with open(args.token_file) as fh:
            token = fh.read().strip()
    else:
        token = os.environ.get("SPOT_ORCHESTRATOR_TOKEN", "")
    if not token:
        parser.error("no token: pass --token-file or set SPOT_ORCHESTRATOR_TOKEN")
    kwargs = {"instance_id": args.instance_id}
    if args.metadata_url:
        kwargs["base_url"] = args.metadata_url
    loop = WatchLoop(WATCHERS[args.cloud](**kwargs), NoticeReporter(args.api, token), interval=args.interval)
    try:
        loop.run()
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

