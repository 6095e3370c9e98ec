"""Counters of one connector worker (thread-safe, JSON-ready), served by the control endpoint's
GET /v1/stats: what was saved, loaded, dropped and repaired, and the last requests' cache records.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass


@dataclass
class RequestRecord:
    """What one request got from the caches when it was admitted."""

    request_id: str
    prompt_tokens: int
    local_hit_tokens: int    # vLLM's own prefix cache on this replica
    loaded_tokens: int       # fetched from the shard stores
    recomputed_tokens: int   # prompt tokens this replica had to compute
    failed_blocks: int = 0   # promised by the lookup but not recoverable at load time


class KVStats:
    COUNTERS = (
        "blocks_saved", "bytes_saved", "blocks_already_stored", "blocks_dropped", "blocks_save_failed",
        "blocks_loaded", "bytes_loaded", "blocks_load_failed", "tokens_loaded", "tokens_recomputed",
        "requests", "requests_hit", "flushes",
        "repair_passes", "groups_repaired", "shards_repaired", "groups_unrecoverable", "repair_failures",
        "repair_bytes",
    )

    def __init__(self, recent: int = 256):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.COUNTERS, 0)
        self._recent: deque[RequestRecord] = deque(maxlen=recent)
        self._records: dict[str, RequestRecord] = {}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def admitted(self, record: RequestRecord) -> None:
        with self._lock:
            if len(self._recent) == self._recent.maxlen:
                self._records.pop(self._recent[0].request_id, None)
            self._recent.append(record)
            self._records[record.request_id] = record
            self._counts["requests"] += 1
            self._counts["requests_hit"] += record.loaded_tokens > 0
            self._counts["tokens_loaded"] += record.loaded_tokens
            self._counts["tokens_recomputed"] += record.recomputed_tokens

    def load_failed(self, request_id: str, blocks: int, block_size: int) -> None:
        """A promised block could not be recovered: vLLM recomputes it and all after it."""
        with self._lock:
            self._counts["blocks_load_failed"] += blocks
            self._counts["tokens_loaded"] -= blocks * block_size
            self._counts["tokens_recomputed"] += blocks * block_size
            record = self._records.get(request_id)
            if record is not None:
                record.failed_blocks += blocks
                record.loaded_tokens -= blocks * block_size
                record.recomputed_tokens += blocks * block_size

    def snapshot(self, **gauges: int) -> dict:
        with self._lock:
            return {**self._counts, **gauges, "recent_requests": [asdict(r) for r in self._recent]}
