"""Connection and request limits of the load balancer (and of the daemon's API server).

`Limits` holds them, with defaults that protect: a request body of at most 16 MiB (413 beyond),
headers within 10 s of the connection or of their first byte and at most 64 KiB (408, 431), a
body within 30 s (408), kept-alive connections idle at most 30 s, at most 4,096 connections per
server, and optionally at most N concurrent streams per client address (429). `protocol_class`
makes the uvicorn protocol that enforces the connection part: each server has a
`ConnectionGuard`, and the load balancers of one process also share a `ProcessBudget` sized from
the process's open-file limit, so that however many connections clients open, the process keeps
files for its other work (the daemon beside it, its database, its upstream connections). A
connection beyond a cap takes the place of the longest-idle one (a connection with no request
in progress); when none is idle it is refused with a 503. LoadBalancer.start and
orchestrator.control.gate use them; docs/hostile-input.md has the reasons and the numbers.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, fields

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orchestrator.common.errors import UserError

# Files the process keeps for everything but client connections (the daemon's API and its
# connections, the database, logs, the replicas' pipes), at most a quarter of its limit.
RESERVED_FILES = 1024
# Each client connection of a load balancer may hold an upstream connection as well.
FILES_PER_CONNECTION = 2
_LOCK = threading.Lock()  # guards every guard and the budget: load balancers run on their own threads


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 16 << 20
    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 30.0
    max_connections: int = 4096
    max_streams_per_client: int | None = None  # None: no per-client limit

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Limits:
        """Defaults, overridden by SPOT_ORCHESTRATOR_LB_<FIELD> (e.g. ..._LB_MAX_CONNECTIONS=8192,
        ..._LB_MAX_STREAMS_PER_CLIENT=16). Raises UserError for a value that is not a positive number."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in fields(cls):
            name = f"SPOT_ORCHESTRATOR_LB_{field.name.upper()}"
            raw = environ.get(name)
            if raw is None or raw == "":
                continue
            kind = float if field.name.endswith("_s") else int
            try:
                value = kind(raw)
            except ValueError:
                raise UserError(f"{name}: expected a number, got {raw!r}") from None
            if not value > 0 or value == float("inf"):
                raise UserError(f"{name}: expected a positive number, got {raw!r}")
            values[field.name] = value
        return cls(**values)


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard one; the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


class ProcessBudget:
    """Client connections all load balancers of this process may hold together."""

    def __init__(self, capacity: int | None = None):
        if capacity is None:
            files = raise_open_file_limit()
            capacity = (files - min(RESERVED_FILES, files // 4)) // FILES_PER_CONNECTION
        self.capacity = capacity
        self.guards: list[ConnectionGuard] = []

    def used(self) -> int:
        return sum(len(g) for g in self.guards)

    def oldest_idle(self) -> ConnectionGuard | None:
        """The guard whose longest-idle connection has been idle longest (under _LOCK)."""
        best, since = None, None
        for guard in self.guards:
            first = guard.oldest_idle_since()
            if first is not None and (since is None or first < since):
                best, since = guard, first
        return best


_process_budget: ProcessBudget | None = None


def process_budget() -> ProcessBudget:
    global _process_budget
    with _LOCK:
        if _process_budget is None:
            _process_budget = ProcessBudget()
        return _process_budget


class ConnectionGuard:
    """One server's connections: idle ones in the order they became idle, busy ones apart.
    `budget` (the process's, for load balancers) bounds several guards together."""

    def __init__(self, limits: Limits, name: str = "server", budget: ProcessBudget | None = None):
        self.limits = limits
        self.name = name
        self.budget = budget
        self._idle: OrderedDict[_Guarded, float] = OrderedDict()
        self._busy: set[_Guarded] = set()
        self.evicted = 0  # idle connections closed to make room
        self.refused = 0  # connections refused with every one busy
        if budget is not None:
            with _LOCK:
                budget.guards.append(self)

    def __len__(self) -> int:
        return len(self._idle) + len(self._busy)

    def close(self) -> None:
        """Leave the process budget (the server stopped)."""
        if self.budget is not None:
            with _LOCK:
                if self in self.budget.guards:
                    self.budget.guards.remove(self)

    def oldest_idle_since(self) -> float | None:
        return next(iter(self._idle.values()), None)

    def _pop_oldest_idle(self) -> _Guarded | None:
        if not self._idle:
            return None
        return self._idle.popitem(last=False)[0]

    def admit(self, conn: _Guarded) -> bool:
        """Count a new connection in, making room by closing the longest-idle one when a cap is
        reached; False (and counted as refused) when every connection is busy."""
        with _LOCK:
            victim = None
            if len(self) >= self.limits.max_connections:
                victim = self._pop_oldest_idle()
            elif self.budget is not None and self.budget.used() >= self.budget.capacity:
                owner = self.budget.oldest_idle()
                victim = owner._pop_oldest_idle() if owner is not None else None
            else:
                self._idle[conn] = time.monotonic()
                return True
            if victim is None:
                self.refused += 1
                return False
            victim._guard.evicted += 1
            self._idle[conn] = time.monotonic()
        if victim is not None:
            victim.evict()
        return True

    def busy(self, conn: _Guarded) -> None:
        with _LOCK:
            if self._idle.pop(conn, None) is not None:
                self._busy.add(conn)

    def idle(self, conn: _Guarded) -> None:
        with _LOCK:
            if conn in self._busy:
                self._busy.discard(conn)
                self._idle[conn] = time.monotonic()

    def remove(self, conn: _Guarded) -> None:
        with _LOCK:
            self._idle.pop(conn, None)
            self._busy.discard(conn)


# Every 503 says when to come back: a replica the daemon's probes find ready joins the LB within
# one probe pass (2 s), and a connection slot frees as fast; clients that honour it back off.
RETRY_AFTER_S = 2
RETRY_AFTER = (b"retry-after", str(RETRY_AFTER_S).encode())


def error_body(status: int, message: str, kind: str) -> bytes:
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}


class _Guarded(HttpToolsProtocol):
    """uvicorn's httptools protocol under a ConnectionGuard, with header limits."""

    _guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._awaiting_headers = True
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        if not self._guard.admit(self):
            self._answer_and_close(503, "server_error", "too many connections; try again shortly")
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        waiting = self._awaiting_headers
        if waiting and self._header_timer is None:  # the first byte after an idle keep-alive wait
            self._arm_header_timer()
        super().data_received(data)
        if waiting and self._awaiting_headers:  # all of it went to headers still incomplete
            self._header_bytes += len(data)
            if self._header_bytes > self._guard.limits.max_header_bytes:
                self._answer_and_close(431, "invalid_request_error",
                                       f"request headers over {self._guard.limits.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._cancel_header_timer()
        self._guard.busy(self)
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._awaiting_headers, self._header_bytes = True, 0
            self._guard.idle(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.remove(self)
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._answer_and_close(400, "invalid_request_error", msg)

    def evict(self) -> None:
        """Close this idle connection to make room (from any thread)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.transport.close()
        else:
            self.loop.call_soon_threadsafe(self.transport.close)

    # -- helpers ----------------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self._guard.limits.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self._awaiting_headers or self.transport.is_closing():
            return
        if self._header_bytes:  # a request began and did not finish its headers in time
            self._answer_and_close(408, "invalid_request_error", "request headers not received in time")
        else:
            self.transport.close()

    def _answer_and_close(self, status: int, kind: str, message: str) -> None:
        body = error_body(status, message, kind)
        retry = b"%s: %s\r\n" % RETRY_AFTER if status == 503 else b""
        head = (f"HTTP/1.1 {status} ".encode() + _REASONS.get(status, b"Error") + b"\r\ncontent-type: "
                b"application/json\r\ncontent-length: " + str(len(body)).encode() + b"\r\n" + retry +
                b"connection: close\r\n\r\n")
        self._guard.remove(self)
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self.transport.write(head + body)
            self.transport.close()


def protocol_class(guard: ConnectionGuard, base: type = HttpToolsProtocol) -> type:
    """A uvicorn `http` protocol class for one server, under `guard` (`base`: a subclass of
    uvicorn's HttpToolsProtocol to build on, e.g. the LB's write-coalescing one)."""
    bases = (_Guarded,) if base is HttpToolsProtocol else (_Guarded, base)
    return type(f"Guarded{base.__name__}", bases, {"_guard": guard})


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


async def read_body(receive, max_bytes: int, timeout_s: float) -> bytes:
    """A request's whole body. Raises BodyTooLarge past `max_bytes`, TimeoutError when it takes
    longer than `timeout_s`, ClientGone when the client disconnects."""
    chunks, size = [], 0
    async with asyncio.timeout(timeout_s):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge
                chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class StreamSlots:
    """Concurrent streams per client address (the LB's own loop only: no lock)."""

    def __init__(self, per_client: int | None):
        self.per_client = per_client
        self._open: dict[str, int] = {}

    def acquire(self, client: str) -> bool:
        if self.per_client is None:
            return True
        count = self._open.get(client, 0)
        if count >= self.per_client:
            return False
        self._open[client] = count + 1
        return True

    def release(self, client: str) -> None:
        if self.per_client is None:
            return
        count = self._open.get(client, 0) - 1
        if count > 0:
            self._open[client] = count
        else:
            self._open.pop(client, None)
