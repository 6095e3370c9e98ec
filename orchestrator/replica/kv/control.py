"""The connector's control endpoint inside the vLLM worker: flush on notice, and stats.

    POST /v1/flush[?timeout_s=60]  push every full block not yet stored; answers when done:
                                200 {"flushed": true, "pending_blocks": 0, "waited_s": ...}
                                504 {"flushed": false, ...} when the timeout passed first
    GET  /v1/stats              the worker's counters (orchestrator.replica.kv.stats) as JSON

The daemon's migrator calls both. Every call needs `Authorization: Bearer <secret>` (the shard
stores' secret); 401 otherwise. A stdlib server on a daemon thread: it must live in the worker
process, which owns the save queue, and must not pull a web framework into vLLM's process.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)


class ControlServer:
    """Serves the two routes on host:port (0: any free port). Raises OSError when it cannot listen."""

    def __init__(self, host: str, port: int, secret: str, *, flush: Callable[[float], bool],
                 pending: Callable[[], int], stats: Callable[[], dict]):
        expected = f"Bearer {secret}".encode()

        class Handler(BaseHTTPRequestHandler):
            def _authorized(self) -> bool:
                presented = self.headers.get("Authorization", "").encode()
                if hmac.compare_digest(presented, expected):
                    return True
                self._reply(401, {"error": "unauthorized"})
                return False

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if not self._authorized():
                    return
                if urlsplit(self.path).path == "/v1/stats":
                    self._reply(200, stats())
                else:
                    self._reply(404, {"error": "not found"})

            def do_POST(self) -> None:  # noqa: N802
                if not self._authorized():
                    return
                url = urlsplit(self.path)
                if url.path != "/v1/flush":
                    self._reply(404, {"error": "not found"})
                    return
                try:
                    timeout_s = float(parse_qs(url.query).get("timeout_s", ["60"])[0])
                except ValueError:
                    self._reply(400, {"error": "timeout_s: expected a number of seconds"})
                    return
                started = time.monotonic()
                done = flush(timeout_s)
                self._reply(200 if done else 504, {"flushed": done, "pending_blocks": pending(),
                                                   "waited_s": round(time.monotonic() - started, 3)})

            def log_message(self, format: str, *args) -> None:  # noqa: A002
                log.debug("kv control: " + format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.address = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
