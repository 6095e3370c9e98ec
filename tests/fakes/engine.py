"""A stand-in for vLLM in control-plane tests: a real HTTP server process on --port that
answers /health and OpenAI-shaped /v1/completions. Used where the test is about the
control plane (reconcile, probes, the API), not about the engine. `--ready-after S` makes
/health answer 503 for the first S seconds (a cold start)."""

from __future__ import annotations

import argparse
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--ready-after", type=float, default=0.0)
    opts, _ = parser.parse_known_args()
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                warm = time.monotonic() - started >= opts.ready_after
                self._json(200 if warm else 503, {"ok": warm})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": opts.name, "object": "model"}]})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length", 0))
            req = json.loads(self.rfile.read(length) or b"{}")
            self._json(200, {"id": "cmpl-1", "object": "text_completion", "model": req.get("model"),
                             "choices": [{"index": 0, "text": f"from {opts.port}", "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})

    server = ThreadingHTTPServer(("127.0.0.1", opts.port), Handler)
    print(f"fake engine {opts.name} listening on port {opts.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
