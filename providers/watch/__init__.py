"""The in-VM half of each provider: a watcher of the cloud's metadata service for notices.

Runs in the replica runtime (the agent loads a watcher by entry point, group
`spot_orchestrator.notice_watchers`), so these modules import only the standard library and
httpx. A watcher has `source`, `interval` and `poll(client) -> [(key, notice)]`, where a
notice is the dict the daemon's /v1/notices takes and the key de-duplicates repeats.
"""

from __future__ import annotations

import datetime as dt

PREEMPT, REBALANCE, MAINTENANCE = "preempt", "rebalance", "maintenance"

Keyed = tuple[str, dict]  # (de-duplication key, notice dict)


def notice(instance_id: str, kind: str, deadline: float, source: str) -> dict:
    return {"instance_id": instance_id, "kind": kind, "deadline": deadline, "source": source}


def iso(text: str) -> float:
    """Unix seconds of an RFC 3339 time."""
    return dt.datetime.fromisoformat(text).timestamp()
