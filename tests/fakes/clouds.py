"""A tiny real HTTP server on 127.0.0.1 for faking cloud endpoints (GCP, Azure, metadata servers).

A test gives it a `route(request) -> (status, body)` function; the server records every
request it saw. Bodies that are dicts/lists are sent as JSON, str/bytes as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclasses.dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body or b"null")


Reply = tuple[int, object] | tuple[int, object, dict[str, str]]


@dataclasses.dataclass
class FakeServer:
    url: str
    requests: list[Request]

    @property
    def host(self) -> str:
        return self.url.removeprefix("http://")


@contextlib.contextmanager
def serve(route: Callable[[Request], Reply]) -> Iterator[FakeServer]:
    seen: list[Request] = []

    class Handler(BaseHTTPRequestHandler):
        def _handle(self):
            parsed = urllib.parse.urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            request = Request(self.command, parsed.path, dict(urllib.parse.parse_qsl(parsed.query)),
                              {k.lower(): v for k, v in self.headers.items()}, self.rfile.read(length))
            seen.append(request)
            status, body, *extra = route(request)
            headers = extra[0] if extra else {}
            if isinstance(body, dict | list):
                payload, ctype = json.dumps(body).encode(), "application/json"
            else:
                payload = body.encode() if isinstance(body, str) else bytes(body or b"")
                ctype = "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", headers.pop("Content-Type", ctype))
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

        def log_message(self, *args):  # keep test output quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield FakeServer(f"http://127.0.0.1:{server.server_address[1]}", seen)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextlib.contextmanager
def serving(fake):
    """`fake` (an object with a `route` method) served on 127.0.0.1, its server at `fake.server`."""
    with serve(fake.route) as server:
        fake.server = server
        yield fake
