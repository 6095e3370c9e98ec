"""The shard store each replica's agent runs: an authenticated, memory-bounded HTTP cache.

Server: `StoreHandler`, served by orchestrator.replica.kv.httpserver (bodies land in their final
buffer). Routes: PUT/GET/HEAD/DELETE /v1/shards/{key}; POST /v1/batch/{put,get,head,has,delete}
(bodies: orchestrator.replica.kv.wire; `head` returns each value's first wire.HEAD_BYTES and, like
`has`, leaves its LRU place and TTL); GET /metrics (Prometheus); GET /healthz. Every request needs
`Authorization: Bearer <secret>` (compared in constant time), else 401. Memory is bounded by
`max_bytes` (value + key bytes) with LRU eviction; an item expires `ttl_s` after its last put or get.

Client: `StoreClient` (pooled keep-alive connections per store), used by the pool, and
`gather_until`, which runs calls against several stores in parallel and returns as soon as enough
answered. docs/kv-cache.md has the status codes and the measured throughput.
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from orchestrator.replica.kv import wire
from orchestrator.replica.kv.httpserver import Request, Response
from orchestrator.replica.kv.transport import BulkTransport, PeerTLS
from orchestrator.common.retry import retry

SHARDS = "/v1/shards/"
BATCH = "/v1/batch/"
MAX_BODY = 512 << 20  # one request


# -- the memory ------------------------------------------------------------------------


@dataclass
class _Stats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected: int = 0
    lru_evictions: int = 0
    ttl_evictions: int = 0
    unauthorized: int = 0


class ShardMemory:
    """An LRU map of key -> bytes bounded by bytes, with an idle TTL. Not thread-safe:
    the server touches it only from its event loop. ValueError unless both bounds are positive."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if max_bytes <= 0 or ttl_s <= 0:
            raise ValueError("max_bytes and ttl_s must be positive")
        self.max_bytes, self.ttl_s, self._clock = max_bytes, ttl_s, clock
        self._items: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # oldest touch first
        self.bytes = 0
        self.stats = _Stats()

    @staticmethod
    def _cost(key: str, value: bytes) -> int:
        return len(key) + len(value)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: str, value: bytes) -> bool:
        """Store (or replace) a value; False when it alone exceeds the bound."""
        cost = self._cost(key, value)
        if cost > self.max_bytes:
            self.stats.rejected += 1
            return False
        self._drop(key)
        now = self._clock()
        self._expire(now)
        while self.bytes + cost > self.max_bytes:
            old_key, (old_value, _) = self._items.popitem(last=False)
            self.bytes -= self._cost(old_key, old_value)
            self.stats.lru_evictions += 1
        self._items[key] = (value, now + self.ttl_s)
        self.bytes += cost
        self.stats.puts += 1
        return True

    def get(self, key: str) -> bytes | None:
        now = self._clock()
        self._expire(now)
        entry = self._items.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._items[key] = (entry[0], now + self.ttl_s)
        self._items.move_to_end(key)
        self.stats.hits += 1
        return entry[0]

    def has(self, key: str) -> bool:
        return self.peek(key) is not None

    def peek(self, key: str) -> bytes | None:
        """The value without touching it (its LRU place and TTL stay as they were)."""
        self._expire(self._clock())
        entry = self._items.get(key)
        return None if entry is None else entry[0]

    def delete(self, key: str) -> bool:
        return self._drop(key)

    def _drop(self, key: str) -> bool:
        entry = self._items.pop(key, None)
        if entry is None:
            return False
        self.bytes -= self._cost(key, entry[0])
        return True

    def _expire(self, now: float) -> None:
        # Touch order is expiry order (one TTL for all), so expired items sit at the front.
        while self._items:
            key, (value, expires) = next(iter(self._items.items()))
            if expires > now:
                return
            del self._items[key]
            self.bytes -= self._cost(key, value)
            self.stats.ttl_evictions += 1


class _MemoryCollector:
    """Prometheus view of a ShardMemory, read at scrape time (no cost per request)."""

    def __init__(self, memory: ShardMemory):
        self.memory = memory

    def collect(self):
        mem, stats = self.memory, self.memory.stats
        gauges = (
            ("spot_kv_store_bytes", "Bytes held (values + keys)", mem.bytes),
            ("spot_kv_store_max_bytes", "Configured memory bound", mem.max_bytes),
            ("spot_kv_store_items", "Shards held", len(mem)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        evictions = CounterMetricFamily("spot_kv_store_evictions", "Shards evicted", labels=["reason"])
        evictions.add_metric(["lru"], stats.lru_evictions)
        evictions.add_metric(["ttl"], stats.ttl_evictions)
        yield evictions
        counters = (
            ("spot_kv_store_hits", "Gets that found the shard", stats.hits),
            ("spot_kv_store_misses", "Gets that did not", stats.misses),
            ("spot_kv_store_puts", "Shards stored", stats.puts),
            ("spot_kv_store_rejected", "Shards larger than the memory bound", stats.rejected),
            ("spot_kv_store_unauthorized", "Requests without the right secret", stats.unauthorized),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


# -- the server ------------------------------------------------------------------------


def _text(status: int, message: str) -> Response:
    return Response(status, [message.encode()], b"text/plain")


class StoreHandler:
    """The requests of one shard store (runs on the server's event loop, synchronously).
    ValueError for an empty secret."""

    def __init__(self, secret: str, max_bytes: int = 1 << 30, ttl_s: float = 3600.0):
        if not secret:
            raise ValueError("the shard store needs a non-empty secret")
        self._expected = f"Bearer {secret}".encode()
        self.memory = ShardMemory(max_bytes, ttl_s)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_MemoryCollector(self.memory))

    def admit(self, request: Request) -> Response | None:
        """The 401 for a request without the secret (checked before its body is read)."""
        if hmac.compare_digest(request.headers.get(b"authorization", b""), self._expected):
            return None
        self.memory.stats.unauthorized += 1
        return _text(401, "missing or wrong bearer token")

    def __call__(self, request: Request) -> Response:
        refusal = self.admit(request)
        if refusal is not None:
            return refusal
        method, path = request.method, request.path
        if path.startswith(SHARDS) and len(path) > len(SHARDS):
            return self._single(method, path[len(SHARDS):], request.body)
        if path.startswith(BATCH) and method == "POST":
            try:
                return self._batch(path[len(BATCH):], request.body)
            except wire.WireError as err:
                return _text(400, str(err))
        if path == "/metrics" and method == "GET":
            return Response(200, [generate_latest(self.registry)], b"text/plain; version=0.0.4")
        if path == "/healthz" and method == "GET":
            return _text(200, "ok")
        return _text(404, "no such route")

    def _single(self, method: str, key: str, body: bytes | memoryview) -> Response:
        mem = self.memory
        if method == "PUT":
            return Response(204 if mem.put(key, body) else 413)
        if method == "GET":
            value = mem.get(key)
            return Response(404) if value is None else Response(200, [value])
        if method == "HEAD":
            return Response(200 if mem.has(key) else 404)
        if method == "DELETE":
            return Response(204 if mem.delete(key) else 404)
        return _text(405, f"{method} not allowed on shards")

    def _batch(self, op: str, body: bytes | memoryview) -> Response:
        mem = self.memory
        if op == "put":  # copy each shard out of the body, so the bound counts what is held
            return Response(200, [wire.encode_flags([mem.put(k, bytes(v)) for k, v in wire.decode_items(body)])])
        if op == "get":
            return Response(200, wire.encode_values([mem.get(key) for key in wire.decode_keys(body)]))
        if op == "head":
            heads = (mem.peek(key) for key in wire.decode_keys(body))
            return Response(200, wire.encode_values([None if v is None else v[:wire.HEAD_BYTES] for v in heads]))
        if op in ("has", "delete"):
            act = mem.has if op == "has" else mem.delete
            return Response(200, [wire.encode_flags([act(key) for key in wire.decode_keys(body)])])
        return _text(404, f"no batch operation {op!r}")


# -- the client ------------------------------------------------------------------------


class StoreUnavailable(Exception):
    """A store could not be reached or answered with an error."""


# Worth a retry: the store is there but slow or the connection broke mid-way. A refused
# connection is not: the store is gone, and the caller treats its shards as erasures.
_RETRYABLE = (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class StoreClient:
    """Calls to one shard store over a pooled keep-alive connection pool. Thread-safe.

    Every call raises StoreUnavailable when the store cannot be reached (a timeout or a broken
    connection is retried once, a refused connection or a failed TLS handshake is not), rejects
    the secret (401), answers 400, 405 or 5xx, or sends a malformed batch body. With `tls` the
    store's http:// endpoint is spoken to over TLS on the same port (the store tells the two
    apart), verified as PeerTLS says. `on_bytes(sent, received)` is told the body bytes of every
    exchange (the pool's egress meter)."""

    def __init__(self, endpoint: str, secret: str, timeout_s: float = 2.0, attempts: int = 2,
                 max_connections: int = 8, tls: PeerTLS | None = None,
                 on_bytes: Callable[[int, int], None] | None = None):
        self.endpoint = endpoint.rstrip("/")
        if tls is not None and self.endpoint.startswith("http://"):
            self.endpoint = "https://" + self.endpoint[len("http://"):]
        self._attempts = attempts
        self._on_bytes = on_bytes
        bulk = self.endpoint.startswith("http://") or tls is not None
        self._http = httpx.Client(
            base_url=self.endpoint,
            headers={"authorization": f"Bearer {secret}"},
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 1.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=BulkTransport(max_connections, tls=tls) if bulk else None,
        )

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, content: bytes | list | None = None) -> httpx.Response:
        """One request (retried once on a timeout or a broken connection). A list `content`
        is sent part by part with a Content-Length, not joined into one more copy."""
        headers = {"content-length": str(sum(len(p) for p in content))} if isinstance(content, list) else None

        def attempt() -> httpx.Response:
            return self._http.request(method, path, content=content, headers=headers)

        try:
            response = retry(attempt, retry_on=_RETRYABLE, attempts=self._attempts, base=0.05, cap=0.5)
        except httpx.HTTPError as err:
            raise StoreUnavailable(f"{self.endpoint}: {type(err).__name__}: {err}") from err
        if self._on_bytes is not None:
            sent = sum(len(p) for p in content) if isinstance(content, list) else len(content or b"")
            self._on_bytes(sent, len(response.content))
        if response.status_code == 401:
            raise StoreUnavailable(f"{self.endpoint}: 401 unauthorized (wrong kv secret?)")
        if response.status_code >= 500 or response.status_code in (400, 405):
            raise StoreUnavailable(f"{self.endpoint}: HTTP {response.status_code}: {response.text[:200]}")
        return response

    def put(self, key: str, value: bytes | memoryview) -> bool:
        return self._call("PUT", SHARDS + quote(key, safe=""), [memoryview(value).cast("B")]).status_code == 204

    def get(self, key: str) -> bytes | None:
        response = self._call("GET", SHARDS + quote(key, safe=""))
        return response.content if response.status_code == 200 else None

    def has(self, key: str) -> bool:
        return self._call("HEAD", SHARDS + quote(key, safe="")).status_code == 200

    def delete(self, key: str) -> bool:
        return self._call("DELETE", SHARDS + quote(key, safe="")).status_code == 204

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> list[bool]:
        if not items:
            return []
        response = self._call("POST", BATCH + "put", wire.encode_items(items))
        return self._flags(response, len(items))

    def get_many(self, keys: Sequence[str]) -> list[memoryview | None]:
        return self._values("get", keys)

    def head_many(self, keys: Sequence[str]) -> list[memoryview | None]:
        """The first wire.HEAD_BYTES of each value (None: absent), without refreshing them."""
        return self._values("head", keys)

    def _values(self, op: str, keys: Sequence[str]) -> list[memoryview | None]:
        if not keys:
            return []
        response = self._call("POST", BATCH + op, wire.encode_keys(keys))
        try:
            return wire.decode_values(response.content, len(keys))
        except wire.WireError as err:
            raise StoreUnavailable(f"{self.endpoint}: bad batch response: {err}") from err

    def has_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return self._flags(self._call("POST", BATCH + "has", wire.encode_keys(keys)), len(keys))

    def delete_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return self._flags(self._call("POST", BATCH + "delete", wire.encode_keys(keys)), len(keys))

    def _flags(self, response: httpx.Response, count: int) -> list[bool]:
        try:
            if response.status_code == 413:
                return [False] * count
            return wire.decode_flags(response.content, count)
        except wire.WireError as err:
            raise StoreUnavailable(f"{self.endpoint}: bad batch response: {err}") from err


T = TypeVar("T")


def gather_until(
    executor: Executor,
    calls: Iterable[Callable[[], T]],
    enough: Callable[[T], bool],
    timeout_s: float,
) -> int:
    """Run calls in parallel, feeding each result to `enough` as it arrives; return once
    `enough` said True, every call finished, or the timeout passed. Failed calls (any
    exception: a store down, a timeout) give no result. Calls still running then are left
    to finish in the background. Returns how many calls failed or were not waited for."""
    pending: set[Future] = {executor.submit(call) for call in calls}
    deadline = time.monotonic() + timeout_s
    failed = 0
    while pending:
        finished, pending = wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                 return_when=FIRST_COMPLETED)
        if not finished:
            break
        for future in finished:
            if future.exception() is not None:
                failed += 1
            elif enough(future.result()):
                return failed + len(pending)
    return failed + len(pending)
