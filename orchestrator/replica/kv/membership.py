"""The shard stores the connector codes over: static ones, its own, and the daemon's list.

The connector makes one Membership and hands its changes to the pool and the repairer. Replicas
come and go, so with a `membership_url` the list is polled (GET, bearer = this replica's own token
from its environment, else the shard-store secret; body {"stores": [...]}) and the pool re-placed
when it changes. A failed poll keeps the last
known list: stores that vanished only cost cache misses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import httpx

from orchestrator.common import identity
from orchestrator.replica.kv.placement import StoreNode, parse_nodes
from orchestrator.replica.kv.settings import ConnectorSettings

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, settings: ConnectorSettings):
        self._settings = settings
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.nodes = self._merge(self._fetch() if settings.membership_url else [])

    def _merge(self, fetched: list[StoreNode]) -> list[StoreNode]:
        by_id = {n.node_id: n for n in (*self._settings.stores, *fetched)}
        own = self._settings.self_store
        if own is not None:
            by_id[own.node_id] = own
        return sorted(by_id.values(), key=lambda n: n.node_id)

    def _fetch(self) -> list[StoreNode]:
        url = self._settings.membership_url
        token = identity.own_token(self._settings.secret)
        try:
            reply = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=self._settings.timeout_s)
            reply.raise_for_status()
            return parse_nodes(reply.json()["stores"])
        except Exception as err:  # the daemon may be restarting: keep serving with what we know
            log.warning("kv membership from %s unavailable: %s", url, err)
            return list(getattr(self, "nodes", []))

    def watch(self, on_change: Callable[[list[StoreNode]], None]) -> None:
        """Poll the daemon in the background; call on_change with each new list."""
        if not self._settings.membership_url or self._thread is not None:
            return

        def poll() -> None:
            while not self._stop.wait(self._settings.membership_poll_s):
                nodes = self._merge(self._fetch())
                if nodes and nodes != self.nodes:
                    log.info("kv stores changed: %d -> %d", len(self.nodes), len(nodes))
                    self.nodes = nodes
                    on_change(nodes)

        self._thread = threading.Thread(target=poll, name="kv-membership", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
