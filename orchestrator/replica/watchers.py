"""Replica-side notice watching: poll a cloud's metadata watcher, report each notice once.

Runs on each replica machine beside vLLM (the agent starts it). The cloud-specific watchers
are the providers' in-VM halves, found by entry point (group `spot_orchestrator.notice_watchers`),
so this module names no cloud and imports nothing from the control plane. A notice is only
marked reported after the daemon's `/v1/notices` accepted it, so a failed POST is retried.

Run one: python -m orchestrator.replica.watchers --cloud NAME --api http://daemon:8080 --token-file F
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from importlib import metadata

import httpx

log = logging.getLogger(__name__)

NOTICES_PATH = "/v1/notices"
# The providers' registry names the same group (providers/registry.py); a test keeps them equal.
WATCHER_ENTRY_POINT_GROUP = "spot_orchestrator.notice_watchers"


def watcher_names() -> list[str]:
    """The clouds whose notice watchers are installed, sorted."""
    return sorted(ep.name for ep in metadata.entry_points(group=WATCHER_ENTRY_POINT_GROUP))


def load_watcher(name: str) -> type:
    """The watcher class registered under `name`; raises KeyError naming the installed ones."""
    for ep in metadata.entry_points(group=WATCHER_ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    raise KeyError(f"no notice watcher {name!r} is installed (installed: {', '.join(watcher_names()) or 'none'})")


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
    parser.add_argument("--cloud", required=True, choices=watcher_names())
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
    loop = WatchLoop(load_watcher(args.cloud)(**kwargs), NoticeReporter(args.api, token), interval=args.interval)
    try:
        loop.run()
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

