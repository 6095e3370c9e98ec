"""An httpx transport for bulk bytes: keep-alive HTTP/1.1 over the stdlib's http.client.

StoreClient uses it for http:// shard stores. Why: httpx's default transport parses responses
with h11 in pure Python, 64 KiB at a time, copying each chunk three times; on a 2-core machine
that made the shard client, not the network, the bottleneck (about 0.7 GB/s per connection).
http.client reads a Content-Length body with one C-level read and sends a body with one sendall.
The httpx API above it (timeouts, exceptions, Response) stays the same, so callers do not know.
With a `PeerTLS` it speaks https:// instead, verifying the store against the service's CA and
the name in its certificate (the connector does that for stores in another cloud).
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class PeerTLS:
    """How to verify one store: the service CA's context and the name its certificate carries."""

    context: ssl.SSLContext
    server_name: str


def client_tls_context(ca_file: str) -> ssl.SSLContext:
    """Trusts only the service's CA (no system roots); checks names. OSError / ssl.SSLError
    for an unreadable CA file."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=ca_file)
    return context


class BulkTransport(httpx.BaseTransport):
    """A pool of idle keep-alive connections per (host, port); thread-safe."""

    def __init__(self, max_idle_per_host: int = 8, tls: PeerTLS | None = None):
        self._max_idle = max_idle_per_host
        self._tls = tls
        self._idle: dict[tuple[str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """One exchange. Raises httpx's exceptions, as its own transport would:
        UnsupportedProtocol for another scheme, ConnectError / ConnectTimeout, ReadTimeout,
        RemoteProtocolError."""
        scheme = "https" if self._tls is not None else "http"
        if request.url.scheme != scheme:
            raise httpx.UnsupportedProtocol(f"this BulkTransport speaks {scheme}://, not {request.url.scheme}")
        address = (request.url.host, request.url.port or (443 if self._tls else 80))
        timeouts = request.extensions.get("timeout", {})
        try:
            body = request.content  # given as bytes
        except httpx.RequestNotRead:  # given as parts: sent one by one (Content-Length is set)
            body = list(request.stream)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        path = request.url.raw_path.decode("ascii")
        conn, reused = self._checkout(address, timeouts, request)
        try:
            try:
                status, response_headers, content, keep = self._exchange(conn, request.method, path, body, headers,
                                                                         timeouts)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ssl.SSLEOFError):
                if not reused:
                    raise
                # The store closed an idle keep-alive connection: once more on a fresh one.
                conn.close()
                conn, reused = self._connect(address, timeouts, request), False
                status, response_headers, content, keep = self._exchange(conn, request.method, path, body, headers,
                                                                         timeouts)
        except Exception as err:
            conn.close()
            raise _as_httpx_error(err, request) from err
        if keep:
            self._checkin(address, conn)
        else:
            conn.close()
        return httpx.Response(status, headers=response_headers, content=content, request=request)

    @staticmethod
    def _exchange(conn, method, path, body, headers, timeouts):
        conn.sock.settimeout(timeouts.get("write"))
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        conn.endheaders(body if body else None)
        conn.sock.settimeout(timeouts.get("read"))
        response = conn.getresponse()
        content = response.read()
        return response.status, response.getheaders(), content, not response.will_close

    def _checkout(self, address, timeouts, request) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop(), True
        return self._connect(address, timeouts, request), False

    def _connect(self, address, timeouts, request) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(address[0], address[1], timeout=timeouts.get("connect"))
        try:
            conn.connect()
            if self._tls is not None:  # what HTTPSConnection does, with the certificate's name, not the address
                conn.sock = self._tls.context.wrap_socket(conn.sock, server_hostname=self._tls.server_name)
        except TimeoutError as err:
            conn.close()
            raise httpx.ConnectTimeout(f"connect to {address[0]}:{address[1]} timed out", request=request) from err
        except ssl.SSLError as err:  # a store whose certificate the service's CA did not sign
            conn.close()
            raise httpx.ConnectError(f"TLS with {address[0]}:{address[1]} failed: {err}", request=request) from err
        except OSError as err:
            conn.close()
            raise httpx.ConnectError(f"connect to {address[0]}:{address[1]}: {err}", request=request) from err
        return conn

    def _checkin(self, address, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


def _as_httpx_error(err: BaseException, request: httpx.Request) -> BaseException:
    """The httpx exception a caller of httpx expects for a socket-level failure."""
    if isinstance(err, httpx.HTTPError):
        return err
    if isinstance(err, ConnectionRefusedError | socket.gaierror):
        return httpx.ConnectError(str(err), request=request)
    if isinstance(err, TimeoutError):
        return httpx.ReadTimeout(str(err) or "timed out", request=request)
    if isinstance(err, http.client.HTTPException | ConnectionError):
        return httpx.RemoteProtocolError(f"{type(err).__name__}: {err}", request=request)
    if isinstance(err, OSError):
        return httpx.ConnectError(f"{type(err).__name__}: {err}", request=request)
    return err
