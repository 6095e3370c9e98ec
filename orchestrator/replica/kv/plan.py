"""Scheduler side of the connector: which blocks to load, which to save, step by step.

Runs in vLLM's scheduler process (one SchedulerPlanner per engine, made by the connector). Per
running request it keeps the block ids and how many blocks were handed over for saving, and
turns each SchedulerOutput into a StepPlan for the workers: a block is saved in the step whose
forward pass writes its last token's KV (not again if it was a hit), and a new request loads the
longest stored prefix past vLLM's own hit, looked up on a helper thread so that a slow store
delays only that request. Limits (one full-attention KV cache group, no speculative decoding,
one more recomputed block under async scheduling): docs/kv-cache.md.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from orchestrator.replica.kv.keys import block_keys, present_prefix_length
from orchestrator.replica.kv.stats import RequestRecord

log = logging.getLogger(__name__)

LOOKUP_WAIT_S = 0.05  # how long one scheduler step waits for a pool lookup before moving on


@dataclass
class BlockLoad:
    request_id: str
    block_ids: list[int]
    keys: list[str]


@dataclass
class StepPlan(KVConnectorMetadata):
    """What the workers do around one forward pass (plain data: it may cross processes)."""

    loads: list[BlockLoad] = field(default_factory=list)
    save_block_ids: list[int] = field(default_factory=list)
    save_keys: list[str] = field(default_factory=list)
    admissions: list[RequestRecord] = field(default_factory=list)


class SchedulerPlanner:
    def __init__(self, pool: Any, tag: str, block_size: int):
        self._pool = pool
        self._tag = tag
        self._block_size = block_size
        self._requests: dict[str, Any] = {}           # vLLM Request objects, by id
        self._lookups: dict[str, tuple[int, int]] = {}  # id -> (local tokens, stored blocks past them)
        self._loads: dict[str, BlockLoad] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._next_save: dict[str, int] = {}          # id -> index of the first block not handed over
        self._pending: dict[str, tuple[int, Future]] = {}  # lookups in flight
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-lookup")

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens loadable from the pool beyond the local hit (a block multiple), or None when
        the lookup is still running: vLLM then asks again at its next step, so a slow or
        unreachable store delays this request only, never the scheduler's other requests."""
        bs = self._block_size
        first = num_computed_tokens // bs
        last = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        if last <= first:
            return 0
        rid = request.request_id
        cached = self._lookups.get(rid)
        if cached is not None and cached[0] == num_computed_tokens:
            return cached[1] * bs  # vLLM may ask again for a waiting request: no new round trip
        pending = self._pending.get(rid)
        if pending is None or pending[0] != num_computed_tokens:
            keys = block_keys(self._tag, request.block_hashes[first:last])
            pending = self._pending[rid] = (num_computed_tokens, self._executor.submit(self._stored_prefix, rid, keys))
        try:
            hit = pending[1].result(timeout=LOOKUP_WAIT_S)
        except TimeoutError:
            return None
        del self._pending[rid]
        self._lookups[rid] = (num_computed_tokens, hit)
        return hit * bs

    def _stored_prefix(self, request_id: str, keys: list[str]) -> int:
        try:
            return present_prefix_length(self._pool.has_many(keys))
        except Exception as err:  # stores unreachable: a miss, not an error
            log.warning("kv lookup failed, computing %s from scratch: %s", request_id, err)
            return 0

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        bs = self._block_size
        local, _ = self._lookups.get(request.request_id, (0, 0))
        first, count = local // bs, num_external_tokens // bs
        self._loads[request.request_id] = BlockLoad(
            request.request_id, list(block_ids[first:first + count]),
            block_keys(self._tag, request.block_hashes[first:first + count]))

    def build(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan()
        bs = self._block_size
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            self._lookups.pop(rid, None)
            self._block_ids[rid] = list(new.block_ids[0])
            self._next_save[rid] = new.num_computed_tokens // bs
            load = self._loads.pop(rid, None)
            loaded = len(load.keys) * bs if load else 0
            prompt = len(new.prompt_token_ids or ())
            plan.admissions.append(RequestRecord(
                rid, prompt, local_hit_tokens=new.num_computed_tokens - loaded, loaded_tokens=loaded,
                recomputed_tokens=max(0, prompt - new.num_computed_tokens)))
            if load:
                plan.loads.append(load)
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid in cached.resumed_req_ids:  # back from preemption: a fresh block table
                self._lookups.pop(rid, None)
                self._block_ids[rid] = list(new_ids[0]) if new_ids else []
                load = self._loads.pop(rid, None)
                if load:
                    plan.loads.append(load)
            elif new_ids and rid in self._block_ids:
                self._block_ids[rid].extend(new_ids[0])
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            self._plan_saves(plan, rid, scheduled)
        return plan

    def _plan_saves(self, plan: StepPlan, rid: str, scheduled: int) -> None:
        request, ids = self._requests.get(rid), self._block_ids.get(rid)
        if request is None or ids is None:
            return
        start = self._next_save.get(rid, 0)
        full = min((request.num_computed_tokens + scheduled) // self._block_size,
                   len(request.block_hashes), len(ids))
        if full <= start:
            return
        for index, key in enumerate(block_keys(self._tag, request.block_hashes[start:full]), start):
            if ids[index] != 0:  # 0 is vLLM's null block
                plan.save_block_ids.append(ids[index])
                plan.save_keys.append(key)
        self._next_save[rid] = full

    def forget(self, request_id: str) -> None:
        for table in (self._requests, self._lookups, self._pending, self._loads, self._block_ids, self._next_save):
            table.pop(request_id, None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
