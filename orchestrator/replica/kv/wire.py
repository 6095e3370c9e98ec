"""The binary bodies of the shard store's batch endpoints (shared by server and client).

Raw length-prefixed records, not JSON: shards are large opaque bytes, and base64 or
multipart would cost a copy and a parse per shard. Little endian throughout.

    keys    (get/head/has/delete requests): repeated  u16 key length, key (UTF-8)
    items   (put request):             repeated  u16 key length, key, u32 value length, value
    values  (get/head response):       repeated  u32 value length (0xFFFFFFFF: absent), value
                                       (head: only the first HEAD_BYTES of each value)
    flags   (put/has/delete response): one byte per key, 1 = stored / present / deleted

encode_keys and encode_items raise WireError for a key that is empty or over MAX_KEY_BYTES; the
decode_* functions for a truncated body, an empty or non-UTF-8 key, or a count that does not match.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

MAX_KEY_BYTES = 1024
HEAD_BYTES = 64  # what `head` returns of each value: enough for any shard header
ABSENT = 0xFFFFFFFF
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


class WireError(ValueError):
    """A malformed batch body."""


def _key_bytes(key: str) -> bytes:
    raw = key.encode()
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise WireError(f"key must be 1..{MAX_KEY_BYTES} bytes of UTF-8, got {len(raw)}")
    return raw


def encode_keys(keys: Iterable[str]) -> bytes:
    parts: list[bytes] = []
    for key in keys:
        raw = _key_bytes(key)
        parts += (_U16.pack(len(raw)), raw)
    return b"".join(parts)


def encode_items(items: Iterable[tuple[str, bytes | memoryview]]) -> list[bytes | memoryview]:
    """The put body as a list of parts (sent one by one, never joined)."""
    parts: list[bytes | memoryview] = []
    for key, value in items:
        raw, data = _key_bytes(key), memoryview(value).cast("B")  # byte-sized items: len() is the size
        parts += (_U16.pack(len(raw)) + raw + _U32.pack(len(data)), data)
    return parts


def encode_values(values: Iterable[bytes | None]) -> list[bytes]:
    parts: list[bytes] = []
    for value in values:
        if value is None:
            parts.append(_U32.pack(ABSENT))
        else:
            parts += (_U32.pack(len(value)), value)
    return parts


def _read(view: memoryview, offset: int, length: int) -> tuple[memoryview, int]:
    end = offset + length
    if end > len(view):
        raise WireError("batch body truncated")
    return view[offset:end], end


def decode_keys(body: bytes | memoryview) -> list[str]:
    view, offset, keys = memoryview(body), 0, []
    while offset < len(view):
        size, offset = _U16.unpack(_read(view, offset, 2)[0])[0], offset + 2
        raw, offset = _read(view, offset, size)
        keys.append(_decode_key(raw))
    return keys


def decode_items(body: bytes | memoryview) -> list[tuple[str, memoryview]]:
    view, offset, items = memoryview(body), 0, []
    while offset < len(view):
        size, offset = _U16.unpack(_read(view, offset, 2)[0])[0], offset + 2
        raw, offset = _read(view, offset, size)
        length, offset = _U32.unpack(_read(view, offset, 4)[0])[0], offset + 4
        value, offset = _read(view, offset, length)
        items.append((_decode_key(raw), value))
    return items


def decode_values(body: bytes | memoryview, count: int) -> list[memoryview | None]:
    view, offset, values = memoryview(body), 0, []
    for _ in range(count):
        length, offset = _U32.unpack(_read(view, offset, 4)[0])[0], offset + 4
        if length == ABSENT:
            values.append(None)
        else:
            value, offset = _read(view, offset, length)
            values.append(value)
    if offset != len(view):
        raise WireError(f"batch response has trailing bytes after {count} values")
    return values


def decode_flags(body: bytes, count: int) -> list[bool]:
    if len(body) != count:
        raise WireError(f"expected {count} flags, got {len(body)}")
    return [b == 1 for b in body]


def encode_flags(flags: Sequence[bool]) -> bytes:
    return bytes(1 if f else 0 for f in flags)


def _decode_key(raw: memoryview) -> str:
    if not raw:
        raise WireError("empty key")
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError as err:
        raise WireError("key is not UTF-8") from err
