"""Pushes staged KV blocks to the erasure-coded pool from a background thread.

The connector's worker makes one BlockSaver. The forward pass only copies finished blocks into
host memory (orchestrator.replica.kv.staging) and submits them here; encoding and the network
happen on this thread, so serving never waits on a store. The queue is bounded by bytes: when
the stores are too slow, new blocks are dropped (counted), because a missing block is only a
cache miss, never wrong output.

`flush()` is what a preemption notice calls (through orchestrator.replica.kv.control): it returns
once every block handed over before the call is stored (or failed), the moment the replica may
be killed losing no more than its last partial block per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.replica.kv.stats import KVStats

log = logging.getLogger(__name__)


class BlockPool(Protocol):
    """The part of orchestrator.replica.kv.pool.ErasureCodedPool the connector uses."""

    def put_many(self, items: list[tuple[str, Any]]) -> None: ...
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...
    def has_many(self, keys: list[str]) -> list[bool]: ...
    def close(self) -> None: ...


@dataclass
class StagedBlocks:
    """Blocks copied off the device: row i of `rows` (uint8, one row per block) is keys[i]'s payload."""

    keys: list[str]
    rows: Any                 # numpy uint8 [n, payload_bytes], a view of host memory
    ready: Any = None         # an event to wait on before reading rows (GPU copies), or None

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)

    def wait(self):
        if self.ready is not None:
            self.ready.synchronize()
        return self.rows


class KnownKeys:
    """Keys this replica stored or loaded recently (bounded LRU): no need to push them again."""

    def __init__(self, capacity: int = 200_000):
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)
                return True
            return False

    def add(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self._capacity:
                self._keys.popitem(last=False)

    def newest(self) -> list[str]:
        """The keys, most recently stored or loaded first (a snapshot)."""
        with self._lock:
            return list(reversed(self._keys))

    def discard(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)


class BlockSaver:
    def __init__(self, pool: BlockPool, stats: KVStats, *, max_pending_bytes: int = 256 << 20,
                 batch_blocks: int = 64, known: KnownKeys | None = None):
        self._pool = pool
        self._stats = stats
        self._max_pending_bytes = max_pending_bytes
        self._batch_blocks = batch_blocks
        self.known = known or KnownKeys()
        self._queue: deque[StagedBlocks] = deque()
        self._cond = threading.Condition()
        self._pending_bytes = 0
        self._submitted = 0   # blocks accepted so far
        self._finished = 0    # blocks stored, already present or failed
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kv-saver", daemon=True)
        self._thread.start()

    def submit(self, staged: StagedBlocks) -> bool:
        """Queue blocks for pushing; False (and counted as dropped) when the queue is full."""
        with self._cond:
            if self._pending_bytes + staged.nbytes > self._max_pending_bytes:
                self._stats.add(blocks_dropped=len(staged.keys))
                log.warning("kv save queue full (%d MiB pending): dropped %d blocks",
                            self._pending_bytes >> 20, len(staged.keys))
                return False
            self.known.add(staged.keys)
            self._queue.append(staged)
            self._pending_bytes += staged.nbytes
            self._submitted += len(staged.keys)
            self._cond.notify_all()
        return True

    def pending_blocks(self) -> int:
        with self._cond:
            return self._submitted - self._finished

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every block submitted before this call is pushed; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._submitted
            while self._finished < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        self._stats.add(flushes=1)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Push what is queued (up to timeout_s), then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                staged = self._queue.popleft()
            try:
                self._push(staged)
            finally:
                with self._cond:
                    self._pending_bytes -= staged.nbytes
                    self._finished += len(staged.keys)
                    self._cond.notify_all()

    def _push(self, staged: StagedBlocks) -> None:
        rows = staged.wait()
        for start in range(0, len(staged.keys), self._batch_blocks):
            keys = staged.keys[start:start + self._batch_blocks]
            try:
                present = self._pool.has_many(keys)
                todo = [i for i, flag in enumerate(present) if not flag]
                if todo:
                    self._pool.put_many([(keys[i], rows[start + i].data) for i in todo])
                self._stats.add(blocks_saved=len(todo), bytes_saved=sum(rows[start + i].nbytes for i in todo),
                                blocks_already_stored=len(keys) - len(todo))
            except Exception as err:  # a store outage must never reach the serving path
                self.known.discard(keys)
                self._stats.add(blocks_save_failed=len(keys))
                log.warning("kv save of %d blocks failed: %s", len(keys), err)
