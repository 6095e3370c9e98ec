"""Shard repair: after the shard stores change, put back the shards of known groups that
their holders lack.

A store that leaves takes one shard of many groups with it (one more loss elsewhere could take
them below k); a store that joins takes over places nobody has filled yet. Each connector worker
runs one Repairer: a few seconds after a membership change (one pass for a burst of them) it
walks the keys its replica stored or loaded recently (saver.KnownKeys), newest first, through
ErasureCodedPool.repair_many, moving at most `max_bytes_per_s` of shard bytes (read + written;
the connector's `repair_mb_per_s`, default 200) so that repair leaves the network and cores to
serving. docs/kv-cache.md has how a group is repaired, the rate limit worked out, and the limits.
"""

from __future__ import annotations

import logging
import threading
import time

from orchestrator.replica.kv.saver import KnownKeys
from orchestrator.replica.kv.stats import KVStats

log = logging.getLogger(__name__)


class Repairer:
    def __init__(self, pool, known: KnownKeys, stats: KVStats, *, batch_keys: int = 64,
                 settle_s: float = 5.0, pause_s: float = 0.01, max_bytes_per_s: float | None = None,
                 clock=time.monotonic, wait=None):
        """`clock` and `wait` (seconds -> None) time the rate limit; wait defaults to the stop
        event's, so close() interrupts a pass that is waiting. Raises ValueError for a
        max_bytes_per_s that is not positive (None: no limit)."""
        if max_bytes_per_s is not None and max_bytes_per_s <= 0:
            raise ValueError(f"max_bytes_per_s must be positive or None, got {max_bytes_per_s}")
        self._pool, self._known, self._stats = pool, known, stats
        self._batch_keys, self._settle_s, self._pause_s = batch_keys, settle_s, pause_s
        self._max_bytes_per_s, self._clock = max_bytes_per_s, clock
        self._due = threading.Event()
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._thread = threading.Thread(target=self._run, name="kv-repair", daemon=True)
        self._thread.start()

    def schedule(self) -> None:
        """The stores changed: a repair pass starts `settle_s` from now (one for a burst)."""
        self._due.set()

    def _run(self) -> None:
        while True:
            self._due.wait()
            if self._stop.wait(self._settle_s):
                return
            self._due.clear()  # a change during the pass schedules the next one
            try:
                self.repair_pass()
            except Exception:  # never let a repair bug reach serving; the next change retries
                log.exception("kv repair pass failed")

    def repair_pass(self) -> dict[str, int]:
        """Repair every known key once; what was done (also added to the stats)."""
        done = {"groups_repaired": 0, "shards_repaired": 0, "groups_unrecoverable": 0, "repair_failures": 0,
                "repair_bytes": 0}
        keys = self._known.newest()
        started = self._clock()
        for start in range(0, len(keys), self._batch_keys):
            if self._stop.is_set():
                break
            batch = keys[start:start + self._batch_keys]
            try:
                results, moved = self._pool.repair_many(batch)
            except Exception as err:  # a store outage: count it, go on with the next batch
                done["repair_failures"] += len(batch)
                log.warning("kv repair of %d groups failed: %s", len(batch), err)
                continue
            done["repair_bytes"] += moved
            lost = [key for key, n in zip(batch, results, strict=True) if n is None]
            self._known.discard(lost)  # nothing left to repair them from
            done["groups_unrecoverable"] += len(lost)
            done["groups_repaired"] += sum(1 for n in results if n)
            done["shards_repaired"] += sum(n for n in results if n)
            self._wait(self._pause_s + self._behind_limit_s(started, done["repair_bytes"]))
        self._stats.add(repair_passes=1, **done)
        if done["shards_repaired"] or done["groups_unrecoverable"]:
            log.info("kv repair: %d shards of %d groups put back, %d groups unrecoverable (of %d known)",
                     done["shards_repaired"], done["groups_repaired"], done["groups_unrecoverable"], len(keys))
        return done

    def _behind_limit_s(self, started: float, moved: int) -> float:
        """How long to wait so that the pass so far averages at most the byte rate limit.
        (The short pause on top leaves the stores and the GIL to serving between batches.)"""
        if self._max_bytes_per_s is None:
            return 0.0
        return max(0.0, started + moved / self._max_bytes_per_s - self._clock())

    def close(self) -> None:
        self._stop.set()
        self._due.set()
        self._thread.join(timeout=5)
