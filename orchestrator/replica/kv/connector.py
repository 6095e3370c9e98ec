"""vLLM KV connector (SpotKVConnector) that keeps every full KV block erasure-coded on the peers' shard stores.

vLLM loads the class by name from this module when a server runs with
    --kv-transfer-config '{"kv_connector": "SpotKVConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "orchestrator.replica.kv.connector", "kv_connector_extra_config": {...}}'
(built by the daemon's launcher, or by settings.transfer_config; the extra config's fields are in
orchestrator.replica.kv.settings). vLLM makes one instance for its scheduler (plan.SchedulerPlanner:
what to load and save each step) and one in each worker (transfer.WorkerTransfers, the saver, the
repairer, and the control endpoint that serves flush and stats). Saves run in the background; a
block that cannot be loaded is recomputed, never a failed request. docs/kv-cache.md describes the
whole path and its limits (one KV cache group, no speculative decoding, tested on CPU with TP 1).
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from orchestrator.common.errors import UserError
from orchestrator.replica.kv.control import ControlServer
from orchestrator.replica.kv.egress import EgressMeter
from orchestrator.replica.kv.keys import layout_tag
from orchestrator.replica.kv.membership import Membership
from orchestrator.replica.kv.plan import SchedulerPlanner, StepPlan
from orchestrator.replica.kv.repair import Repairer
from orchestrator.replica.kv.saver import BlockSaver
from orchestrator.replica.kv.settings import CONNECTOR_NAME, ConnectorSettings, parse_settings
from orchestrator.replica.kv.stats import KVStats
from orchestrator.replica.kv.transfer import WorkerTransfers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _route_logs_through_vllm() -> None:
    """vLLM's logging config only handles the "vllm" logger tree; let ours share its handler."""
    ours, theirs = logging.getLogger("orchestrator.replica.kv"), logging.getLogger("vllm")
    if theirs.handlers and not ours.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = False


def _model_id(vllm_config: VllmConfig, settings: ConnectorSettings) -> str:
    if settings.model_id:
        return settings.model_id
    model = vllm_config.model_config.model
    # A local folder's path differs between machines; its name (for the demo models a
    # content key) does not. Hub names are already global.
    name = os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model
    return f"{name}@{vllm_config.model_config.revision or ''}"


def _attention_group(kv_cache_config: KVCacheConfig):
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"{CONNECTOR_NAME} supports models with one KV cache group, this one has "
                         f"{len(groups)} (hybrid or sliding-window attention)")
    return groups[0]


def _open_pool(settings: ConnectorSettings, membership: Membership, meter: EgressMeter):
    from orchestrator.replica.kv.pool import ErasureCodedPool
    from orchestrator.replica.kv.transport import client_tls_context

    if not membership.nodes:
        raise UserError(f"kv_connector_extra_config: no shard stores known ({settings.membership_url} "
                        "listed none and no 'stores' or own store were given)")
    try:
        tls = client_tls_context(settings.tls_ca_file) if settings.tls_ca_file else None
    except (OSError, ssl.SSLError) as err:
        raise UserError(f"kv_connector_extra_config.tls_ca_file: not a CA certificate: {err}") from None
    return ErasureCodedPool(membership.nodes, settings.secret, k=settings.k, m=settings.m,
                            timeout_s=settings.timeout_s, domain=settings.failure_domain, home=settings.self_store,
                            tls_context=tls, meter=meter)


def _tp_rank_and_size(vllm_config: VllmConfig, role: KVConnectorRole) -> tuple[int, int]:
    size = vllm_config.parallel_config.tensor_parallel_size
    if role != KVConnectorRole.WORKER or size == 1:
        return 0, size
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), size


class SpotKVConnector(KVConnectorBase_V1):
    """The connector vLLM constructs per role. Raises UserError for a bad
    kv_connector_extra_config (or a control port it cannot listen on), ValueError for a model
    with more than one KV cache group."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, not lost data

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _route_logs_through_vllm()
        settings = parse_settings(self._kv_transfer_config.kv_connector_extra_config)
        group = _attention_group(kv_cache_config)
        spec = group.kv_cache_spec
        self._block_size = vllm_config.cache_config.block_size
        tp_rank, tp_size = _tp_rank_and_size(vllm_config, role)
        tag = layout_tag(_model_id(vllm_config, settings), dtype=str(spec.dtype), block_size=self._block_size,
                         num_layers=len(group.layer_names), num_kv_heads=getattr(spec, "num_kv_heads", 0),
                         head_size=getattr(spec, "head_size", 0), tp_size=tp_size, tp_rank=tp_rank)
        self._membership = Membership(settings)
        meter = EgressMeter(settings.egress, settings.self_store)
        self._pool = _open_pool(settings, self._membership, meter)
        self._planner: SchedulerPlanner | None = None
        self._transfers: WorkerTransfers | None = None
        self._saver: BlockSaver | None = None
        self._repairer: Repairer | None = None
        self._control: ControlServer | None = None
        if role == KVConnectorRole.SCHEDULER:
            # vLLM's scheduler reads the policy right after constructing us; "fail" would turn
            # a lost shard group into a failed request instead of a recomputed block.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            if (vllm_config.cache_config.prefix_caching_hash_algo.startswith("xxhash")
                    and "PYTHONHASHSEED" not in os.environ):
                log.warning("kv connector: xxhash block hashes without PYTHONHASHSEED are random per "
                            "process; no other replica will find this replica's blocks")
            self._planner = SchedulerPlanner(self._pool, tag, self._block_size)
        else:
            stats = KVStats()
            self._saver = BlockSaver(self._pool, stats, max_pending_bytes=settings.max_pending_bytes,
                                     batch_blocks=settings.push_batch_blocks)
            self._repairer = Repairer(self._pool, self._saver.known, stats,
                                      max_bytes_per_s=settings.repair_bytes_per_s)
            self._transfers = WorkerTransfers(self._pool, self._saver, stats, layer_names=list(group.layer_names),
                                              num_blocks=kv_cache_config.num_blocks, block_size=self._block_size)
            if settings.control_port is not None:
                port = settings.control_port + tp_rank if settings.control_port else 0
                saver = self._saver
                try:
                    self._control = ControlServer(
                        settings.control_host, port, settings.secret, flush=saver.flush, pending=saver.pending_blocks,
                        stats=lambda: {**stats.snapshot(pending_blocks=saver.pending_blocks()),
                                       "egress": meter.snapshot()})
                except OSError as err:
                    raise UserError(f"kv_connector_extra_config.control_port: cannot listen on "
                                    f"{settings.control_host}:{port}: {err.strerror}") from None
                log.info("kv connector control listening on %s", self._control.address)
        self._membership.watch(self._stores_changed)
        log.info("kv connector %s: role %s, %d stores, k=%d m=%d, failure domain %s, layout %s", CONNECTOR_NAME,
                 role.name, len(self._membership.nodes), settings.k, settings.m, settings.failure_domain, tag)

    def _stores_changed(self, nodes) -> None:
        self._pool.update_nodes(nodes)
        if self._repairer is not None:  # the worker: it knows the keys it stored and loaded
            self._repairer.schedule()

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._transfers is not None
        self._transfers.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._transfers is not None
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan)
        self._transfers.start_step(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # whole blocks (all layers) are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._transfers is not None
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan)
        self._transfers.save_step(plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._transfers.take_invalid_block_ids() if self._transfers else set()

    def shutdown(self) -> None:
        if self._control is not None:
            self._control.close()
        if self._repairer is not None:
            self._repairer.close()
        if self._saver is not None:
            self._saver.close()
        if self._planner is not None:
            self._planner.close()
        self._membership.close()
        self._pool.close()

    # ---- scheduler side ----------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self._planner is not None
        self._planner.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._planner is not None
        return self._planner.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        assert self._planner is not None
        if num_external_tokens > 0:
            self._planner.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._planner is not None
        return self._planner.build(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._planner is not None:
            self._planner.forget(request.request_id)
        return False, None
