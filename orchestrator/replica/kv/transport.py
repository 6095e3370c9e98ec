"""An httpx transport for bulk bytes: keep-alive HTTP/1.1 over the stdlib's http.client.

StoreClient uses it for http:// shard stores. Why: httpx's default transport parses responses
with h11 in pure Python, 64 KiB at a time, copying each chunk three times; on a 2-core machine
that made the shard client, not the network, the bottleneck (about 0.7 GB/s per connection).
http.client reads a Content-Length body with one C-level read and sends a body with one sendall.
The httpx API above it (timeouts, exceptions, Response) stays the same, so callers do not know.
Plain http:// only (the shard stores talk on a private network with a bearer secret); https://
endpoints keep httpx's own transport.
"""

from __future__ import annotations

import http.client
import socket
import threading

import httpx


class BulkTransport(httpx.BaseTransport):
    """A pool of idle keep-alive connections per (host, port); thread-safe."""

    def __init__(self, max_idle_per_host: int = 8):
        self._max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """One exchange. Raises httpx's exceptions, as its own transport would:
        UnsupportedProtocol for another scheme, ConnectError / ConnectTimeout, ReadTimeout,
        RemoteProtocolError."""
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"BulkTransport speaks http:// only, not {request.url.scheme}")
        address = (request.url.host, request.url.port or 80)
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
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
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

    @staticmethod
    def _connect(address, timeouts, request) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(address[0], address[1], timeout=timeouts.get("connect"))
        try:
            conn.connect()
        except TimeoutError as err:
            raise httpx.ConnectTimeout(f"connect to {address[0]}:{address[1]} timed out", request=request) from err
        except OSError as err:
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
