"""The LB's client for non-streamed requests to its replicas: pooled keep-alive HTTP/1.1.

orchestrator.lb.proxy sends every non-streamed http:// request through it (aiohttp still carries
the streams, HEAD and https). Why not aiohttp here: its client spends about as much CPU per
request as the rest of the LB's hop together (request/response objects, header multidicts,
payload wrappers, tracing hooks, timers), and a non-streamed completion is one small request and
one small response on a kept-open connection. This client writes the request in one write and
parses the answer with httptools (uvicorn's parser), on connections it keeps per replica. What it
does not do (TLS, redirects, proxies, cookies, decompression, HEAD) the LB never needs there.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    """The replica could not be reached, or its answer broke off: the LB tries another."""


class UpstreamConnectError(UpstreamError):
    """No connection to the replica (refused, unreachable, or the connect timed out)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request in flight on it at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_timeout: float | None):
        self.loop = loop
        self.idle_timeout = idle_timeout
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.received = False  # any byte of the current answer
        self._parser: httptools.HttpResponseParser | None = None
        self._done: asyncio.Future | None = None
        self._body: list[bytes] = []
        self._content_type = b"application/json"
        self._last_data = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self.received = True
        self._last_data = self.loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(UpstreamError(f"bad HTTP answer: {err}"))

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._fail(UpstreamError(f"connection closed by the replica{f': {exc}' if exc else ''}"))

    # -- httptools callbacks -----------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._content_type = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        done, parser = self._done, self._parser
        self._parser = self._done = None
        self._cancel_timer()
        keep = parser.should_keep_alive()
        if done is not None and not done.done():
            done.set_result((parser.get_status_code(), b"".join(self._body), self._content_type, keep))

    # -- the request -------------------------------------------------------------------
    def send(self, request: bytes) -> asyncio.Future:
        self._parser = httptools.HttpResponseParser(self)
        self._done = self.loop.create_future()
        self._body = []
        self._content_type = b"application/json"
        self.received = False
        self._last_data = self.loop.time()
        if self.idle_timeout is not None:
            self._timer = self.loop.call_later(self.idle_timeout, self._check_idle)
        self.transport.write(request)
        return self._done

    def _check_idle(self) -> None:
        # Re-armed rather than reset on every read: one timer per request, not one per chunk.
        quiet = self.loop.time() - self._last_data
        if quiet < self.idle_timeout:
            self._timer = self.loop.call_later(self.idle_timeout - quiet, self._check_idle)
            return
        self._timer = None
        self._fail(UpstreamError(f"no answer from the replica for {self.idle_timeout:.0f}s"))
        self.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, err: Exception) -> None:
        self._cancel_timer()
        done, self._done, self._parser = self._done, None, None
        if done is not None and not done.done():
            done.set_exception(err)

    def close(self) -> None:
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()


class UpstreamPool:
    """Keep-alive connections per replica address; `request` sends one and returns its answer."""

    def __init__(self, connect_timeout: float = 5.0, idle_timeout: float | None = 600.0, max_idle: int = 64):
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._addresses: dict[str, tuple[str, int, bytes]] = {}

    def _address(self, base_url: str) -> tuple[str, int, bytes]:
        found = self._addresses.get(base_url)
        if found is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamConnectError(f"{base_url}: only http:// replicas are pooled")
            port = parts.port or 80
            found = self._addresses[base_url] = (parts.hostname, port, f"{parts.hostname}:{port}".encode())
        return found

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop, self.idle_timeout), host, port),
                self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as err:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {err or 'timed out'}") from None
        return conn

    async def request(self, base_url: str, method: str, target: str, body: bytes,
                      headers: dict[str, str]) -> tuple[int, bytes, bytes]:
        """(status, body, content type) of one request. A kept-alive connection the replica
        closed meanwhile is replaced once, transparently (nothing of the answer was read).
        Raises UpstreamConnectError when no connection can be made (or the URL is not http://),
        UpstreamError when the answer breaks off, is malformed or stalls for idle_timeout."""
        host, port, host_header = self._address(base_url)
        head = [f"{method} {target} HTTP/1.1".encode(), b"Host: " + host_header,
                b"Content-Length: " + str(len(body)).encode()]
        head += [f"{name}: {value}".encode("latin-1") for name, value in headers.items()]
        request = b"\r\n".join(head) + b"\r\n\r\n" + body
        idle = self._idle.setdefault((host, port), [])
        while True:
            reused = bool(idle)
            conn = idle.pop() if reused else await self._connect(host, port)
            if conn.closed:
                if reused:
                    continue  # closed while it sat idle
                raise UpstreamConnectError(f"{host}:{port} closed the connection at once")
            try:
                status, payload, content_type, keep = await conn.send(request)
            except UpstreamError:
                conn.close()
                if reused and not conn.received:
                    continue  # a stale keep-alive connection: try a fresh one
                raise
            except BaseException:  # cancelled mid-answer (a cut, a client gone): never reuse it
                conn.close()
                raise
            if keep and not conn.closed and len(idle) < self.max_idle:
                idle.append(conn)
            else:
                conn.close()
            return status, payload, content_type

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
