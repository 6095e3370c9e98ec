"""The erasure codec: any k of k+m shards decode bit-exact; bad shards are erasures, never data."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.replica.kv import isal
from orchestrator.replica.kv.codec import HEADER, HEADER_SIZE, Codec, TooManyErasures, WrongPayloadLength, aligned_empty
from tests.helpers import BENCHMARKS

_codecs: dict[tuple[int, int], Codec] = {}


def codec(k: int, m: int) -> Codec:
    if (k, m) not in _codecs:
        _codecs[(k, m)] = Codec(k, m)
    return _codecs[(k, m)]


@st.composite
def coded(draw, max_size: int = 5000):
    """(codec, payload, framed shards as bytes)."""
    k, m = draw(st.integers(1, 10)), draw(st.integers(1, 5))
    payload = draw(st.binary(max_size=max_size))
    c = codec(k, m)
    return c, payload, [bytes(f) for f in c.encode(payload)]


relaxed = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@relaxed
@given(coded(), st.data())
def test_any_m_or_fewer_erasures_decode_bit_exact(sample, data):
    c, payload, frames = sample
    lost = data.draw(st.sets(st.integers(0, c.k + c.m - 1), max_size=c.m))
    kept = [None if i in lost else f for i, f in enumerate(frames)]
    if data.draw(st.booleans()):
        kept = data.draw(st.permutations(kept))  # order does not matter: headers carry the index
    assert c.decode(kept) == payload


@relaxed
@given(coded(max_size=2000), st.data())
def test_more_than_m_erasures_fail_clearly(sample, data):
    c, _, frames = sample
    lost = data.draw(st.sets(st.integers(0, c.k + c.m - 1), min_size=c.m + 1, max_size=c.k + c.m))
    with pytest.raises(TooManyErasures, match=f"need {c.k}"):
        c.decode([None if i in lost else f for i, f in enumerate(frames)])


@relaxed
@given(coded(max_size=3000), st.data())
def test_a_flipped_byte_is_an_erasure(sample, data):
    c, payload, frames = sample
    victim = data.draw(st.integers(0, c.k + c.m - 1))
    position = data.draw(st.integers(0, len(frames[victim]) - 1))
    bit = data.draw(st.integers(0, 7))
    broken = bytearray(frames[victim])
    broken[position] ^= 1 << bit
    assert c.parse(broken) is None
    corrupted = list(frames)
    corrupted[victim] = bytes(broken)
    assert c.decode(corrupted) == payload
    # With m other shards lost as well, too few valid shards remain: an error, not wrong data.
    others = [i for i in range(c.k + c.m) if i != victim][: c.m]
    with pytest.raises(TooManyErasures):
        c.decode([None if i in others else f for i, f in enumerate(corrupted)])


@relaxed
@given(coded(max_size=2000), st.integers(1, 200))
def test_truncated_or_extended_shards_are_erasures(sample, cut):
    c, payload, frames = sample
    assert c.parse(frames[0][:-cut]) is None
    assert c.parse(frames[0] + b"x" * cut) is None
    assert c.parse(frames[0][: min(cut, HEADER_SIZE - 1)]) is None
    assert c.decode([frames[0][:-cut], *frames[1:]]) == payload


def test_shards_of_two_encodings_are_never_mixed():
    c = codec(4, 2)
    old, new = os.urandom(4096), os.urandom(4096)
    a = [bytes(f) for f in c.encode(old)]
    b = [bytes(f) for f in c.encode(new)]
    # 3 of one stripe + 3 of the other: each alone is short of k, so no decode at all.
    with pytest.raises(TooManyErasures):
        c.decode(a[:3] + b[3:])
    # k of the new stripe win over stale shards of the old one.
    assert c.decode(a[:2] + b[2:]) == new


def test_two_encodings_of_one_payload_are_one_stripe():
    """Two replicas storing the same block at once: whichever shard lands last, the group decodes."""
    c = codec(4, 2)
    payload = os.urandom(4096)
    a, b = ([bytes(f) for f in c.encode(payload)] for _ in range(2))
    assert a == b
    assert c.decode(a[:3] + b[3:5]) == payload
    # a repair re-creates the shards of an existing stripe exactly
    old = c.parse(a[0]).stripe
    assert [bytes(f) for f in c.encode(payload, stripe=old)] == a


def test_the_frame_format_is_as_documented():
    # Pinned with zlib, not with the codec's own CRC: a store of another version must agree.
    c, payload = codec(4, 2), os.urandom(1000)
    frames = [bytes(f) for f in c.encode(payload)]
    size = c.shard_len(len(payload))
    padded = payload + bytes(4 * size - len(payload))
    data_crcs = [zlib.crc32(padded[i * size:(i + 1) * size]) for i in range(4)]
    for index, frame in enumerate(frames):
        magic, crc, version, i, k, m, n, length, stripe, reserved = HEADER.unpack_from(frame)
        assert (magic, version, i, k, m, n, length, reserved) == (b"KVEC", 2, index, 4, 2, 1000, size, 0)
        assert stripe == zlib.crc32(struct.pack("<4I", *data_crcs))
        assert crc == zlib.crc32(frame[8:HEADER_SIZE], zlib.crc32(frame[HEADER_SIZE:]))
    assert [f[HEADER_SIZE:] for f in frames[:4]] == [padded[i * size:(i + 1) * size] for i in range(4)]


def test_a_header_alone_identifies_its_shard():
    c, payload = codec(4, 2), os.urandom(10_000)
    frames = c.encode(payload)
    ids = [c.identify(bytes(f[:HEADER_SIZE])) for f in frames]
    assert [i.index for i in ids] == list(range(6)) and {(i.stripe, i.payload_len) for i in ids} == {
        (c.parse(frames[0]).stripe, len(payload))}
    assert c.identify(bytes(frames[0][:HEADER_SIZE - 1])) is None  # short
    assert codec(8, 4).identify(bytes(frames[0][:HEADER_SIZE])) is None  # another code
    assert c.identify(b"x" * HEADER_SIZE) is None


@pytest.mark.parametrize("k,m,n", [(4, 2, 1_000), (4, 2, 4 * 256), (8, 4, 3 << 20), (4, 2, 70), (3, 5, 7_777)])
def test_assemble_into_a_callers_buffer_writes_exactly_the_payload(k, m, n):
    # Erasures of the last data shard with payload bytes (rebuilt aside and trimmed), of data
    # shards that are all padding (n=70, k=4: shards 2 and 3), of parity only, or none.
    c = codec(k, m)
    payload = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    shards = [c.parse(f) for f in c.encode(payload)]
    for lost in ([], list(range(m)), list(range(k - 1, k - 1 + m)), [k - 1]):
        kept = [s for s in shards if s.index not in lost]
        row = np.full(n + 16, 0xAB, dtype=np.uint8)  # guard bytes after the payload
        assert c.assemble(kept, into=row[:n]) is not None
        assert row[:n].tobytes() == payload and (row[n:] == 0xAB).all()
        assert c.assemble(kept) == payload
    row = np.empty(n, dtype=np.uint8)
    assert c.decode([None, *c.encode(payload)[1:]], into=row) is row and row.tobytes() == payload
    with pytest.raises(WrongPayloadLength):
        c.assemble(shards, into=np.empty(n + 1, dtype=np.uint8))


def test_shards_of_another_code_are_erasures():
    frames = codec(4, 2).encode(b"payload" * 100)
    assert codec(3, 3).parse(frames[0]) is None
    assert codec(4, 3).parse(frames[0]) is None


def test_raw_kernel_rebuilds_data_and_parity_into_caller_buffers():
    c = codec(8, 4)
    rng = np.random.default_rng(1)
    data = list(rng.integers(0, 256, (8, 4096), dtype=np.uint8))
    parity = list(np.zeros((4, 4096), dtype=np.uint8))
    c.encode_parity_into(data, parity)
    shards = data + parity
    sources = {i: shards[i] for i in (1, 3, 5, 7, 8, 9, 10, 11)}
    lost = [0, 2, 4, 6]
    out = list(np.zeros((4, 4096), dtype=np.uint8))
    c.recover_into(sources, lost, out)
    assert all(np.array_equal(out[j], data[i]) for j, i in enumerate(lost))
    # parity too (re-creating a lost parity shard elsewhere)
    sources = {i: shards[i] for i in (0, 1, 2, 3, 4, 5, 6, 11)}
    out = list(np.zeros((3, 4096), dtype=np.uint8))
    c.recover_into(sources, [8, 9, 10], out)
    assert all(np.array_equal(out[j], parity[j]) for j in range(3))


def test_large_payload_round_trip():
    c = codec(8, 4)
    payload = os.urandom((3 << 20) + 17)
    frames = c.encode(payload)
    assert c.decode([None, None, None, None, *frames[4:]]) == payload


@pytest.mark.parametrize("k,m,n", [(4, 2, 1), (4, 2, 100_003), (8, 4, 65_536), (3, 5, 7_777), (8, 4, 3 << 20)])
def test_every_shards_data_starts_32_byte_aligned(k, m, n):
    # The AVX2 kernels lose about a quarter of their speed on loads split across cache lines.
    codec = Codec(k, m)
    payload = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    frames = codec.encode(payload)
    assert all(codec.parse(frame).address % 32 == 0 for frame in frames)
    assert codec.decode(frames[m:]) == payload.tobytes()


def test_large_shards_start_in_different_cache_sets():
    # Back to back, 12 shards of 256 KiB would all start at one offset in their pages and
    # contend for the same L1 sets; staggered, each starts on its own cache line mod 4 KiB.
    codec = Codec(8, 4)
    for shards in (codec.shard_views(2 << 20), [memoryview(f)[HEADER_SIZE:] for f in codec.encode(bytes(2 << 20))]):
        lines = {np.frombuffer(s, dtype=np.uint8).ctypes.data % 4096 // 64 for s in shards}
        assert len(lines) == 12
    assert all(v.nbytes == codec.shard_len(2 << 20) for v in codec.shard_views(2 << 20))


def test_aligned_empty_starts_on_the_boundary_and_has_the_length():
    for nbytes in (1, 64, 4097):
        for align in (32, 64, 4096):
            buf = aligned_empty(nbytes, align)
            assert buf.ctypes.data % align == 0 and buf.nbytes == nbytes and buf.dtype == np.uint8


def test_crc_matches_zlib():
    import zlib

    buf = np.frombuffer(os.urandom(100_003), dtype=np.uint8)
    assert isal.crc32(buf.ctypes.data, buf.size) == zlib.crc32(buf.tobytes())


def test_invalid_code_parameters_are_rejected():
    with pytest.raises(ValueError, match="k=0"):
        Codec(0, 2)
    with pytest.raises(ValueError, match="m=0"):
        Codec(4, 0)


def test_missing_isal_is_a_clear_error(monkeypatch):
    isal.load.cache_clear()
    monkeypatch.setattr(isal, "_candidates", lambda: ["/nonexistent/libisal.so.2"])
    try:
        with pytest.raises(isal.IsalUnavailable, match="pip install pyeclib"):
            isal.load()
    finally:
        monkeypatch.undo()
        isal.load.cache_clear()
    assert isal.load() is not None


def test_codec_benchmark_runs_and_reports_its_keys():
    import json
    import subprocess
    import sys

    script = BENCHMARKS / "bench_codec.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "BENCH_CODEC_MIB": "1", "BENCH_CODEC_REPEATS": "2"}, check=True)
    result = json.loads(out.stdout)
    for key in ("encode_k4m2_ratio", "decode_k4m2_ratio", "encode_k8m4_ratio", "decode_k8m4_ratio"):
        assert result[key] > 0


def test_raw_kernel_refuses_mismatched_buffers():
    c = codec(4, 2)
    data = list(np.zeros((4, 128), dtype=np.uint8))
    with pytest.raises(ValueError, match="differ in length"):
        c.encode_parity_into(data, [np.zeros(128, np.uint8), np.zeros(64, np.uint8)])
    with pytest.raises(ValueError, match="expected 4 source"):
        c.encode_parity_into(data[:3], list(np.zeros((2, 128), dtype=np.uint8)))
    with pytest.raises(ValueError, match="writable"):
        c.encode_parity_into(data, [bytes(128), bytes(128)])
