"""Pool keys of KV blocks: vLLM's chained prefix block hash, scoped by the KV layout.

The connector's scheduler (lookups, saves) names blocks with these keys. vLLM hashes each full
block from (parent hash, token ids, extra keys such as LoRA or cache salt), so a block's hash
names the whole prefix up to its end, and every replica of the same model computes the same hash
for the same tokens (sha256, seeded by PYTHONHASHSEED or a fixed default). The layout tag keeps
apart replicas whose KV bytes would differ: another model, dtype, block size, head layout or
tensor-parallel slice never reads our blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

KEY_VERSION = "kv1"


def layout_tag(model_id: str, *, dtype: str, block_size: int, num_layers: int, num_kv_heads: int,
               head_size: int, tp_size: int, tp_rank: int) -> str:
    """A short name for 'KV bytes of this model, laid out this way, from this TP rank'."""
    text = "|".join(str(part) for part in (model_id, dtype, block_size, num_layers, num_kv_heads,
                                           head_size, tp_size))
    return f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.r{tp_rank}"


def block_key(tag: str, block_hash: bytes) -> str:
    return f"{KEY_VERSION}/{tag}/{bytes(block_hash).hex()}"


def block_keys(tag: str, block_hashes: Sequence[bytes]) -> list[str]:
    return [block_key(tag, h) for h in block_hashes]


def present_prefix_length(flags: Sequence[bool]) -> int:
    """How many leading entries are True: a prefix is only usable up to its first hole."""
    for index, flag in enumerate(flags):
        if not flag:
            return index
    return len(flags)
