"""Worker side of the connector: loads into and saves out of vLLM's paged KV cache.

Runs in each vLLM worker process (the connector makes one WorkerTransfers). Loads are
synchronous, before the forward pass that needs them: fetch any k shards per block from the pool,
decode into host rows, scatter into the blocks. Blocks from the first unrecoverable one on are
reported to vLLM as invalid, and vLLM recomputes them. Saves copy the step's finished blocks off
the device and hand them to the BlockSaver thread, so the forward pass never waits on a store.
"""

from __future__ import annotations

import logging
from typing import Any

from orchestrator.replica.kv.plan import BlockLoad, StepPlan
from orchestrator.replica.kv.saver import BlockSaver
from orchestrator.replica.kv.staging import PagedLayout
from orchestrator.replica.kv.stats import KVStats

log = logging.getLogger(__name__)


class WorkerTransfers:
    def __init__(self, pool: Any, saver: BlockSaver, stats: KVStats, *, layer_names: list[str],
                 num_blocks: int, block_size: int):
        self._pool = pool
        self._saver = saver
        self._stats = stats
        self._layer_names = layer_names
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._layout: PagedLayout | None = None
        self._invalid: set[int] = set()

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Take vLLM's KV tensors. Raises ValueError for a missing layer, or what PagedLayout raises."""
        missing = [name for name in self._layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"vLLM registered no KV cache for layer {missing[0]}")
        self._layout = PagedLayout([kv_caches[name] for name in self._layer_names], self._num_blocks)
        log.info("kv connector: %d layers, %d KiB per block payload, block tensor %s",
                 len(self._layer_names), self._layout.payload_bytes >> 10,
                 tuple(kv_caches[self._layer_names[0]].shape))

    def start_step(self, plan: StepPlan) -> None:
        for record in plan.admissions:
            self._stats.admitted(record)
        for load in plan.loads:
            self._load(load, {r.request_id: r for r in plan.admissions}.get(load.request_id))

    def _load(self, load: BlockLoad, record) -> None:
        layout = self._layout
        assert layout is not None, "register_kv_caches comes first"
        rows = layout.host_rows(len(load.keys))
        try:
            payloads = self._pool.get_many(load.keys, into=list(rows))  # None: absent, or not a block of this layout
        except Exception as err:
            log.warning("kv load for %s failed: %s", load.request_id, err)
            payloads = [None] * len(load.keys)
        good = 0
        for payload in payloads:
            if payload is None:
                break  # a prefix is only usable up to its first hole
            good += 1
        try:
            layout.scatter_rows(load.block_ids[:good], rows[:good])
        except Exception as err:
            log.warning("kv scatter for %s failed: %s", load.request_id, err)
            good = 0
        self._saver.known.add(load.keys[:good])
        self._stats.add(blocks_loaded=good, bytes_loaded=good * layout.payload_bytes)
        failed = len(load.keys) - good
        recomputed = (record.recomputed_tokens if record else 0) + failed * self._block_size
        if failed:
            self._invalid.update(load.block_ids[good:])
            self._stats.load_failed(load.request_id, failed, self._block_size)
            log.warning("kv load for %s: %d of %d blocks unrecoverable, vLLM recomputes them",
                        load.request_id, failed, len(load.keys))
        log.info("external cache hit: %d tokens loaded for %s (%d blocks), %d tokens recomputed",
                 good * self._block_size, load.request_id, good, recomputed)

    def save_step(self, plan: StepPlan) -> None:
        if not plan.save_keys or self._layout is None:
            return
        chosen: dict[str, int] = {}  # two requests with one new prefix in a step: same key twice
        for block_id, key in zip(plan.save_block_ids, plan.save_keys, strict=True):
            if key not in chosen and key not in self._saver.known:
                chosen[key] = block_id
        if chosen:
            self._saver.submit(self._layout.gather(list(chosen.values()), list(chosen)))

    def take_invalid_block_ids(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid
