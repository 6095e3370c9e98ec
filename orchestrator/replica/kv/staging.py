"""Copies whole KV blocks between vLLM's paged cache and host memory, all layers at once.

The connector's worker (orchestrator.replica.kv.transfer) makes one PagedLayout over vLLM's
per-layer KV tensors. A block's payload is its page in every layer, in the layer order of the
KV cache group: one payload, one erasure-coded group and one pool key per block hash. The only
layout fact relied on is vLLM's (0.32): per-layer views with blocks at dim 0, a scheduler block
possibly split into `ratio` kernel blocks. Saves: one gather per layer and one stacked
device->host copy per step; loads decode straight into `host_rows`, and `scatter_rows` writes
them with one host->device copy and one indexed write per layer. On GPU the host buffers are
pinned and the save copy asynchronous; that branch has not run on a GPU (docs/kv-cache.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from orchestrator.replica.kv.saver import StagedBlocks


class PagedLayout:
    """The block layout of vLLM's KV tensors. Raises ValueError for no layers, layers of
    different shapes or dtypes, or a block count at dim 0 that is no multiple of num_blocks."""

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int):
        if not layers:
            raise ValueError("no KV cache layers to stage")
        first = layers[0]
        for layer in layers:
            if layer.shape != first.shape or layer.dtype != first.dtype:
                raise ValueError("the connector needs KV layers of one shape and dtype")
        if first.shape[0] % num_blocks:
            raise ValueError(f"KV layer has {first.shape[0]} blocks at dim 0, not a multiple of "
                             f"the scheduler's {num_blocks}")
        self.layers = list(layers)
        self.ratio = first.shape[0] // num_blocks
        self.device = first.device
        self.dtype = first.dtype
        self.block_shape = (self.ratio,) + tuple(first.shape[1:])
        self.block_elems = int(np.prod(self.block_shape))
        self.payload_bytes = self.block_elems * first.element_size() * len(self.layers)

    def _kernel_indices(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        if self.ratio > 1:
            ids = (ids[:, None] * self.ratio + torch.arange(self.ratio)[None, :]).reshape(-1)
        return ids.to(self.device)

    def gather(self, block_ids: Sequence[int], keys: list[str]) -> StagedBlocks:
        """Copy these blocks (all layers) to host memory; row i is the payload of keys[i]."""
        n = len(block_ids)
        index = self._kernel_indices(block_ids)
        stacked = torch.stack([layer.index_select(0, index).reshape(n, -1) for layer in self.layers], dim=1)
        if self.device.type == "cpu":
            return StagedBlocks(keys, stacked.reshape(n, -1).view(torch.uint8).numpy())
        host = torch.empty(stacked.shape, dtype=self.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        if ready is not None:
            ready.record()
        else:
            torch.accelerator.synchronize()  # other accelerators: plain synchronous copy
        # The numpy view keeps the pinned tensor alive; it is read only after `ready`.
        return StagedBlocks(keys, host.reshape(n, -1).view(torch.uint8).numpy(), ready)

    def host_rows(self, n: int) -> np.ndarray:
        """n uninitialised payload rows in host memory for loads to decode into (pinned on a
        GPU, so `scatter_rows` copies them to the device without staging them again)."""
        if self.device.type == "cpu":
            return np.empty((n, self.payload_bytes), dtype=np.uint8)
        return torch.empty((n, self.payload_bytes), dtype=torch.uint8, pin_memory=True).numpy()

    def scatter_rows(self, block_ids: Sequence[int], rows: np.ndarray) -> None:
        """Write host rows (row i: the payload of block_ids[i], as `host_rows` gives them)
        into these blocks of every layer."""
        n = len(block_ids)
        if n == 0:
            return
        src = torch.from_numpy(rows[:n])
        if self.device.type != "cpu":
            src = src.to(self.device, non_blocking=True)  # rows are pinned: an async copy
        src = src.view(self.dtype).reshape(n, len(self.layers), self.block_elems)
        index = self._kernel_indices(block_ids)
        for i, layer in enumerate(self.layers):
            layer.index_copy_(0, index, src[:, i].reshape((n * self.ratio,) + self.block_shape[1:]))
