"""A small HTTP/1.1 server for bulk bodies, on asyncio's BufferedProtocol (uvloop if present).

The agent serves its shard store (orchestrator.replica.kv.store) with it. Why not uvicorn: an
ASGI server hands a body to the app 64 KiB at a time, one event-loop round trip per chunk (an
8 MiB shard batch arrived at about 0.5 GB/s); here the socket is read straight into the body's
final buffer (about 3 GB/s; docs/kv-cache.md). It does what the store needs: Content-Length
bodies, keep-alive, a synchronous handler per request. Chunked bodies get 411, heads over 16 KiB
431; a refused request (`admit`, or a body over `max_body`: 413) is answered at once and its
body read past unbuffered, so the client sees the status rather than a reset connection.
With an SSL context the same port also speaks TLS: each accepted connection's first byte (peeked,
not read) tells a TLS ClientHello from plain HTTP, so peers in this cloud keep plain HTTP and
peers in another cloud are encrypted, on one endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import unquote

import numpy as np

log = logging.getLogger(__name__)

MAX_HEAD = 16 << 10
IDLE_TIMEOUT_S = 120.0
TLS_RECORD_HANDSHAKE = 0x16  # the first byte of a TLS ClientHello; never the start of an HTTP method


@dataclass
class Request:
    method: str
    path: str  # percent-decoded, without the query string
    headers: dict[bytes, bytes]  # lower-case names
    body: bytes | memoryview  # memoryview: a large body, read straight into its own buffer


@dataclass
class Response:
    status: int
    body: Sequence[bytes | bytearray | memoryview] = ()  # written with one writelines (no join)
    content_type: bytes = b"application/octet-stream"


Handler = Callable[[Request], Response]
# Called with the head (body still unread): a Response refuses the request before any body
# buffer is allocated (authentication), None lets it through.
Admit = Callable[[Request], Response | None]


class _Connection(asyncio.BufferedProtocol):
    """One client connection: head into a scratch buffer, body straight into its own buffer."""

    def __init__(self, handler: Handler, admit: Admit | None, max_body: int):
        self._handler, self._admit, self._max_body = handler, admit, max_body
        self._scratch = bytearray(64 << 10)
        self._head = bytearray()
        self._request: Request | None = None  # set while its body is being read
        self._body: memoryview | None = None
        self._received = 0
        self._transport: asyncio.Transport | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._discard = 0  # body bytes of a refused request still to skip

    # -- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._touch()

    def connection_lost(self, exc) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._transport = None

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self._body is not None:
            return memoryview(self._body)[self._received:]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self._touch()
        if self._discard:
            skipped = min(nbytes, self._discard)
            self._discard -= skipped
            if skipped == nbytes:
                return
            self._head += memoryview(self._scratch)[skipped:nbytes]
            self._process_head()
            return
        if self._body is not None:
            self._received += nbytes
            if self._received == len(self._body):
                self._finish_body()
            return
        self._head += memoryview(self._scratch)[:nbytes]
        self._process_head()

    def pause_writing(self) -> None:  # the client is not reading its responses: stop reading requests
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    # -- parsing -------------------------------------------------------------------------

    def _process_head(self) -> None:
        while self._transport is not None and self._body is None:
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > MAX_HEAD:
                    self._fail(431)
                return
            head, rest = bytes(self._head[:end]), self._head[end + 4:]
            self._head = bytearray()
            request, length = self._parse(head)
            if request is None:
                return
            refusal = self._admit(request) if self._admit is not None else None
            if refusal is None and length > self._max_body:
                refusal = Response(413, [b"body too large"], b"text/plain")
            if refusal is not None:  # answer now; its body is read past, never buffered
                self._write(refusal, send_body=request.method != "HEAD")
                self._discard = max(0, length - len(rest))
                self._head = rest[length:] if length <= len(rest) else bytearray()
                if self._discard:
                    return
                continue
            if length <= len(rest):
                request.body = bytes(rest[:length])
                self._head = rest[length:]
                self._dispatch(request)
            else:
                # numpy's empty: no zero-fill pass over a buffer the socket is about to fill
                self._request, self._body = request, memoryview(np.empty(length, dtype=np.uint8))
                self._body[:len(rest)] = rest
                self._received = len(rest)

    def _parse(self, head: bytes) -> tuple[Request | None, int]:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self._fail(400)
            return None, 0
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                self._fail(400)
                return None, 0
            headers[name.strip().lower()] = value.strip()
        if b"transfer-encoding" in headers:
            self._fail(411)
            return None, 0
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            length = -1
        if length < 0:
            self._fail(400)
            return None, 0
        if parts[2] == b"HTTP/1.0" and headers.get(b"connection", b"").lower() != b"keep-alive":
            headers[b"connection"] = b"close"
        target = parts[1].decode("latin-1").split("?", 1)[0]
        return Request(parts[0].decode("latin-1"), unquote(target), headers, b""), length

    def _finish_body(self) -> None:
        request = self._request
        request.body = self._body
        self._request, self._body, self._received = None, None, 0
        self._dispatch(request)
        self._process_head()

    # -- answering -----------------------------------------------------------------------

    def _dispatch(self, request: Request) -> None:
        try:
            response = self._handler(request)
        except Exception:  # a bug in the handler must not kill the server
            log.exception("shard store: %s %s failed", request.method, request.path)
            response = Response(500, [b"internal error"], b"text/plain")
        close = request.headers.get(b"connection", b"").lower() == b"close"
        self._write(response, send_body=request.method != "HEAD", close=close)

    def _write(self, response: Response, send_body: bool = True, close: bool = False) -> None:
        if self._transport is None:
            return
        length = sum(len(p) for p in response.body)
        reason = HTTPStatus(response.status).phrase.encode()
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            response.status, reason, response.content_type, length, b"connection: close\r\n" if close else b"")
        self._transport.writelines([head, *response.body] if send_body else [head])
        if close:
            self._transport.close()
            self._transport = None

    def _fail(self, status: int) -> None:
        self._write(Response(status, [HTTPStatus(status).phrase.encode()], b"text/plain"), close=True)

    def _touch(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        if self._transport is not None:
            transport = self._transport
            self._idle = asyncio.get_running_loop().call_later(IDLE_TIMEOUT_S, transport.close)


class _SniffingServer:
    """Accepts connections itself and hands each to asyncio plain or under TLS, by its first
    byte. Has what callers use of an asyncio.Server: `sockets` and `close()`."""

    def __init__(self, listener: socket.socket, factory: Callable[[], _Connection], context: ssl.SSLContext):
        self.sockets = [listener]
        self._factory, self._context = factory, context
        self._tasks: set[asyncio.Task] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self.sockets[0])
            task = loop.create_task(self._hand_over(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _hand_over(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            readable = loop.create_future()
            loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
            try:
                await asyncio.wait_for(readable, IDLE_TIMEOUT_S)
            finally:
                loop.remove_reader(conn.fileno())
            first = conn.recv(1, socket.MSG_PEEK)
            if not first:
                conn.close()
                return
            tls = self._context if first[0] == TLS_RECORD_HANDSHAKE else None
            await loop.connect_accepted_socket(self._factory, conn, ssl=tls,
                                               ssl_handshake_timeout=10.0 if tls else None)
        except (OSError, ssl.SSLError, TimeoutError) as err:  # a failed handshake (a wrong CA) or an idle peer
            log.info("shard store: connection dropped before its first request: %s", err)
            conn.close()

    def close(self) -> None:
        self._accepting.cancel()
        for task in list(self._tasks):
            task.cancel()
        self.sockets[0].close()


async def start_server(handler: Handler, host: str, port: int, max_body: int,
                       admit: Admit | None = None, tls: ssl.SSLContext | None = None):
    """Listen on host:port (0 = any free port); the caller closes the returned server (an
    asyncio.Server, or with `tls` one that also speaks TLS on the same port). Raises OSError
    when the address cannot be bound."""
    loop = asyncio.get_running_loop()

    def factory() -> _Connection:
        return _Connection(handler, admit, max_body)

    if tls is None:
        return await loop.create_server(factory, host, port)
    listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=128)
    listener.setblocking(False)
    return _SniffingServer(listener, factory, tls)


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The store's TLS context: its certificate (issued by the service's CA) and key.
    Raises OSError / ssl.SSLError for a missing or mismatched pair."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context
