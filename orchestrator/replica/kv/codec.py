"""Systematic Cauchy Reed-Solomon on ISA-L: k data + m parity shards, any k give the payload back.

The KV pool (orchestrator.replica.kv.pool) frames every block's payload here; the codec
benchmark drives the raw kernel. Two layers:
- the raw kernel, `encode_parity_into` / `recover_into`: pointers into buffers the caller owns,
  nothing allocated, data shards used in place;
- framed shards, `encode` / `decode` / `assemble`: each shard a 32-byte header + S data bytes (S =
  n/k rounded up to 64, the last data shard zero-padded). Header, little endian: magic "KVEC",
  crc32 u32 (of the data, then header bytes 8..31), version u8 (2), index u8, k u8, m u8, payload
  length u64, shard length u32, stripe id u32 (CRC-32 of the data shards' CRCs), reserved u32.
  A corrupt, truncated or foreign shard is an erasure; shards of two stripes are never mixed.
docs/kv-cache.md has the format's history, the buffer layout and the measured speeds.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from orchestrator.replica.kv import isal
MAGIC = b"KVEC"
VERSION = 2  # 1: CRC over header then data, stripe = CRC-32 of the payload
HEADER = struct.Struct("<4sIBBBBQIII")
HEADER_SIZE = HEADER.size  # 32
_U32 = struct.Struct("<I")
_CRC_FROM = 8  # the CRC covers the data, then header bytes 8..31
_HEADER_TAIL = HEADER_SIZE - _CRC_FROM
ALIGN = 64
PAGE = 4096
STAGGER = 352  # frame stride mod PAGE for large shards: 5.5 cache lines, 32-byte aligned data
STAGGER_FROM = 64 << 10  # shard length from which frames are staggered

Buffer = bytes | bytearray | memoryview | np.ndarray


class TooManyErasures(Exception):
    """Fewer than k valid shards: the payload cannot be recovered."""


class WrongPayloadLength(ValueError):
    """`assemble(into=...)` got a buffer of another length than the stored payload's."""


class ShardId(NamedTuple):
    """What a shard's header says it is: its place in the group and its encoding."""

    index: int
    stripe: int
    payload_len: int


class Shard(NamedTuple):
    """A framed shard whose header and CRC checked out."""

    index: int
    payload_len: int
    stripe: int
    frame: memoryview  # header + data; keeps the buffer behind `address` alive
    address: int  # of the data


def _address(buf: Buffer) -> int:
    """The address of a contiguous buffer (read-only ones too: the kernel only reads them)."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def _common_length(inputs: Sequence[Buffer], n_in: int, outputs: Sequence[Buffer], n_out: int) -> int:
    """The one length of all buffers; a mismatch would make the kernel read or write past one."""
    if len(inputs) != n_in or len(outputs) != n_out:
        raise ValueError(f"expected {n_in} source and {n_out} target buffers, got {len(inputs)} and {len(outputs)}")
    lengths = {memoryview(b).nbytes for b in (*inputs, *outputs)}
    if len(lengths) != 1:
        raise ValueError(f"shard buffers differ in length: {sorted(lengths)}")
    for b in outputs:
        if memoryview(b).readonly:
            raise ValueError("target shard buffers must be writable")
    return lengths.pop()


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 buffer whose first byte sits on an `align`-byte boundary.

    numpy's own buffers start 16 bytes past a boundary; the AVX2 kernels then split every
    other 32-byte load across two cache lines, which costs k8m4 about a quarter of its speed
    here (measured: 7.5 vs 9.8 GB/s at 64 MiB). Shard data in a frame sits HEADER_SIZE (32)
    past its start and frame strides are 32 mod 64, so an aligned frame buffer keeps every
    shard's data 32-byte aligned."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes]


def _pointers(addresses: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_void_p * len(addresses))(*addresses)


class Codec:
    """One (k, m) code: its matrices and cached decode tables. Thread-safe. Raises ValueError
    unless 1 <= k, 1 <= m and k + m <= 255, and IsalUnavailable without ISA-L."""

    def __init__(self, k: int = 4, m: int = 2):
        if not (1 <= k and 1 <= m and k + m <= 255):
            raise ValueError(f"need 1 <= k, 1 <= m, k + m <= 255; got k={k}, m={m}")
        self.k, self.m = k, m
        self._lib = isal.load()
        self._crc = isal.crc32_function()
        matrix = np.zeros((k + m, k), dtype=np.uint8)
        self._lib.gf_gen_cauchy1_matrix(matrix.ctypes.data, k + m, k)  # top k rows: identity
        self._matrix = matrix
        self._encode_tables = self._tables(matrix[k:])
        self._decode_tables: dict[tuple[int, ...], np.ndarray] = {}
        self._lock = threading.Lock()

    # -- the raw kernel ------------------------------------------------------------------

    def _tables(self, rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows)
        tables = np.empty(32 * self.k * rows.shape[0], dtype=np.uint8)
        self._lib.ec_init_tables(self.k, rows.shape[0], rows.ctypes.data, tables.ctypes.data)
        return tables

    def shard_len(self, payload_len: int) -> int:
        """Bytes per shard (without header) for a payload of this size."""
        per_shard = -(-max(payload_len, 1) // self.k)
        return -(-per_shard // ALIGN) * ALIGN

    def encode_parity_into(self, data: Sequence[Buffer], parity: Sequence[Buffer]) -> None:
        """Compute the m parity shards of k equal-length data shards into `parity` (in place).
        Raises ValueError for a wrong number of buffers, unequal lengths or a read-only target."""
        length = _common_length(data, self.k, parity, self.m)
        self._lib.ec_encode_data(
            length, self.k, self.m, self._encode_tables.ctypes.data,
            _pointers([_address(d) for d in data]), _pointers([_address(p) for p in parity]),
        )

    def recover_into(
        self, sources: Mapping[int, Buffer], missing: Sequence[int], out: Sequence[Buffer]
    ) -> None:
        """Rebuild shards `missing` into `out` from exactly k shards {index: buffer}. Raises
        ValueError for another number of sources, unequal lengths, read-only targets or an
        index outside 0..k+m-1."""
        indices = tuple(sorted(sources))
        if len(indices) != self.k:
            raise ValueError(f"recover_into needs exactly k={self.k} sources, got {len(indices)}")
        if not missing:
            return
        length = _common_length([sources[i] for i in indices], self.k, out, len(missing))
        if not all(0 <= i < self.k + self.m for i in (*indices, *missing)):
            raise ValueError(f"shard indices must be 0..{self.k + self.m - 1}")
        tables = self._decode_table(indices, tuple(missing))
        self._lib.ec_encode_data(
            length, self.k, len(missing), tables.ctypes.data,
            _pointers([_address(sources[i]) for i in indices]), _pointers([_address(o) for o in out]),
        )

    def _decode_table(self, sources: tuple[int, ...], missing: tuple[int, ...]) -> np.ndarray:
        key = sources + (-1,) + missing
        tables = self._decode_tables.get(key)
        if tables is None:
            square = np.ascontiguousarray(self._matrix[list(sources)])  # gf_invert_matrix clobbers it
            inverse = np.empty_like(square)
            if self._lib.gf_invert_matrix(square.ctypes.data, inverse.ctypes.data, self.k) != 0:
                raise AssertionError(f"singular Cauchy submatrix for shards {sources}")  # MDS: never
            # Row i of the inverse rebuilds data shard i from the sources; parity needs the
            # inverse multiplied by its encode row.
            rows = [inverse[i] if i < self.k else self._gf_matmul(self._matrix[i], inverse) for i in missing]
            tables = self._tables(np.array(rows, dtype=np.uint8))
            with self._lock:
                self._decode_tables[key] = tables
        return tables

    def _gf_matmul(self, row: np.ndarray, square: np.ndarray) -> np.ndarray:
        """row x square over GF(2^8), via the kernel itself (one byte per 'shard')."""
        out = np.zeros(self.k, dtype=np.uint8)
        tables = self._tables(row.reshape(1, -1))
        rows_of = [np.ascontiguousarray(square[j]) for j in range(self.k)]
        self._lib.ec_encode_data(
            self.k, self.k, 1, tables.ctypes.data, _pointers([r.ctypes.data for r in rows_of]),
            _pointers([out.ctypes.data]),
        )
        return out

    # -- framed shards -------------------------------------------------------------------
    # Addresses are computed by arithmetic and copies done with memmove: for KV-block-sized
    # payloads (tens of KiB) numpy views and ctypes conversions would cost more than the coding.

    def encode(self, payload: Buffer, stripe: int | None = None) -> list[memoryview]:
        """The k+m framed shards of a payload (views into one fresh buffer).

        The stripe id comes from the data shards' CRCs (see the module docstring) unless
        `stripe` is given (shard repair re-creates lost shards of an existing encoding, byte
        for byte, so they join the shards still stored). Derived from the content, not
        random: two replicas that store the same block at once write identical shards, and
        whichever lands last on each store, the group stays one encoding; a different
        payload gets another stripe and is never mixed in."""
        src = np.frombuffer(payload, dtype=np.uint8)
        n, k, m = src.size, self.k, self.m
        frames, size, stride = self._frame_buffer(n)
        frame_len = HEADER_SIZE + size
        base, src_base = frames.ctypes.data, src.ctypes.data
        data = [base + i * stride + HEADER_SIZE for i in range(k + m)]
        for i in range(k):
            chunk = max(0, min(size, n - i * size))
            if chunk:
                ctypes.memmove(data[i], src_base + i * size, chunk)
            if chunk < size:
                ctypes.memset(data[i] + chunk, 0, size - chunk)
        self._lib.ec_encode_data(size, k, m, self._encode_tables.ctypes.data, _pointers(data[:k]),
                                 _pointers(data[k:]))
        flat = memoryview(frames)
        crc = self._crc
        data_crcs = [crc(0, address, size) for address in data]
        if stripe is None:
            stripe = zlib.crc32(struct.pack(f"<{k}I", *data_crcs[:k]))
        for i in range(k + m):
            offset = i * stride
            HEADER.pack_into(flat, offset, MAGIC, 0, VERSION, i, k, m, n, size, stripe, 0)
            _U32.pack_into(flat, offset + 4, crc(data_crcs[i], base + offset + _CRC_FROM, _HEADER_TAIL))
        return [flat[i * stride:i * stride + frame_len] for i in range(k + m)]

    def _frame_buffer(self, payload_len: int) -> tuple[np.ndarray, int, int]:
        """A fresh buffer for the k+m frames of a payload, its shard length and frame stride.

        Frames of large shards sit STAGGER bytes apart modulo 4 KiB instead of back to back.
        Back to back, every shard starts at nearly the same offset in its page, so the kernel's
        k+m streams all map to the same few L1 cache sets (8 ways) and evict each other: k8m4
        then ran at 1.1-1.3x memcpy here instead of 1.4-1.6x (k+m = 12 streams; k4m2's 6 fit).
        Small shards keep the plain layout: the padding (< 4 KiB a frame) would cost more
        memory than the conflicts cost time."""
        size = self.shard_len(payload_len)
        stride = HEADER_SIZE + size
        if size >= STAGGER_FROM:
            stride += (STAGGER - stride) % PAGE
        return aligned_empty((self.k + self.m) * stride), size, stride

    def shard_views(self, payload_len: int) -> list[np.ndarray]:
        """The k+m shard data areas of a fresh frame buffer laid out as `encode` lays it out
        (for callers of the raw kernel that fill the data shards themselves)."""
        frames, size, stride = self._frame_buffer(payload_len)
        return [frames[i * stride + HEADER_SIZE:i * stride + HEADER_SIZE + size] for i in range(self.k + self.m)]

    def identify(self, head: Buffer) -> ShardId | None:
        """Which shard a frame claims to be, from its first HEADER_SIZE bytes alone (as a
        store's `head` returns them); None for a foreign or malformed header. Unverified: the
        CRC needs the data, so a corrupt shard with an intact header passes here."""
        view = memoryview(head).cast("B")
        if len(view) < HEADER_SIZE:
            return None
        magic, _, version, index, k, m, n, size, stripe, _ = HEADER.unpack_from(view)
        if (magic, version, k, m) != (MAGIC, VERSION, self.k, self.m) or index >= k + m or size != self.shard_len(n):
            return None
        return ShardId(index, stripe, n)

    def parse(self, frame: Buffer) -> Shard | None:
        """The header and data of a valid shard of this code; None for a corrupt, truncated or
        foreign one (wrong code, wrong version)."""
        view = memoryview(frame).cast("B")
        claimed = self.identify(view)
        if claimed is None or len(view) != HEADER_SIZE + self.shard_len(claimed.payload_len):
            return None
        crc = _U32.unpack_from(view, 4)[0]
        index, stripe, n = claimed
        base = np.frombuffer(view, dtype=np.uint8).ctypes.data
        if self._crc(self._crc(0, base + HEADER_SIZE, len(view) - HEADER_SIZE), base + _CRC_FROM, _HEADER_TAIL) != crc:
            return None
        return Shard(index, n, stripe, view, base + HEADER_SIZE)

    def decode(self, frames: Iterable[Buffer | None], into: Buffer | None = None) -> bytearray | Buffer:
        """The payload from any k valid framed shards (others: corrupt, foreign or None), as
        a new bytearray or written into `into` (see `assemble`).

        Raises TooManyErasures when fewer than k valid shards of one stripe are present, and
        what `assemble` raises for a bad `into`.
        """
        return self.assemble([p for p in (self.parse(f) for f in frames if f is not None) if p is not None], into)

    @staticmethod
    def best_stripe(shards: Sequence[Shard]) -> dict[int, Shard]:
        """{index: shard} of the encoding with the most shards among these (a group can hold
        shards of two writes of its key)."""
        stripes: dict[tuple[int, int], dict[int, Shard]] = {}
        for shard in shards:
            stripes.setdefault((shard.stripe, shard.payload_len), {})[shard.index] = shard
        return max(stripes.values(), key=len, default={})

    def assemble(self, shards: Sequence[Shard], into: Buffer | None = None) -> bytearray | Buffer:
        """The payload from shards already checked by `parse` (the pool parses on arrival):
        a new bytearray, or written into `into` (a writable buffer of exactly the payload's
        length, e.g. a row of the connector's staging array) and `into` returned.

        Raises TooManyErasures with fewer than k shards of one stripe, WrongPayloadLength when
        `into` has another length than the payload, ValueError when it is read-only."""
        best = self.best_stripe(shards)
        if len(best) < self.k:
            raise TooManyErasures(f"only {len(best)} valid shard(s) of {self.k}+{self.m}; need {self.k} to decode")
        chosen = [best[i] for i in sorted(best)[: self.k]]  # data shards first: fewest to rebuild
        n = chosen[0].payload_len
        size, k = self.shard_len(n), self.k
        if into is None:
            out = bytearray(k * size)  # room for the last shard's padding: trimmed in place below
            # the address as a plain int: no buffer export pins `out`, so `del out[n:]` works
            base, room = np.frombuffer(out, dtype=np.uint8).ctypes.data, k * size
        else:
            view = memoryview(into).cast("B")
            if view.readonly:
                raise ValueError("assemble needs a writable buffer")
            if view.nbytes != n:
                raise WrongPayloadLength(f"the payload has {n} bytes, its buffer {view.nbytes}")
            base, room = np.frombuffer(view, dtype=np.uint8).ctypes.data, n
        present = {s.index for s in chosen}
        for shard in chosen:
            if shard.index < k and shard.index * size < n:
                ctypes.memmove(base + shard.index * size, shard.address, min(size, room - shard.index * size))
        # Data shards that are all padding need no rebuild; one that does not fit `room` (the
        # last, padded, shard of a payload written in place) is rebuilt aside and copied.
        missing = [i for i in range(k) if i not in present and i * size < n]
        if missing:
            spill = aligned_empty(size) if (missing[-1] + 1) * size > room else None
            targets = [base + i * size for i in missing]
            if spill is not None:
                targets[-1] = spill.ctypes.data
            indices = tuple(s.index for s in chosen)
            tables = self._decode_table(indices, tuple(missing))
            self._lib.ec_encode_data(size, k, len(missing), tables.ctypes.data,
                                     _pointers([s.address for s in chosen]), _pointers(targets))
            if spill is not None:
                ctypes.memmove(base + missing[-1] * size, spill.ctypes.data, n - missing[-1] * size)
        if into is not None:
            return into
        del out[n:]  # drops the padding of the last data shard (in place)
        return out
