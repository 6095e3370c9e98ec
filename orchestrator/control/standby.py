"""A standby daemon's API: what answers on the daemon's port while another daemon leads the
state database (orchestrator.control.leader). `serve()` starts it before waiting for the leader
lock and stops it once leader, then the full API takes the same port.

/v1/health answers {"status": "ok", "role": "standby"}, so `spotctl` on this host finds a
daemon (and does not try to start a second one beside it); every other route answers 503 with
a one-line detail, which spotctl prints. No state is read: the standby knows nothing yet.
"""

from __future__ import annotations

import os
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from orchestrator.control import auth, discovery, tls
from orchestrator.control.gate import server_config

DETAIL = ("this daemon is a standby: another daemon leads its state database (ask that one); "
          "this one takes over when it stops")


def create_standby_app() -> FastAPI:
    app = FastAPI(title="spot-orchestrator standby daemon", docs_url=None, redoc_url=None, openapi_url=None)
    started_at = time.time()

    @app.get("/v1/health")
    def health() -> dict:
        return {"status": "ok", "role": "standby", "pid": os.getpid(), "started_at": started_at}

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    def elsewhere(request: Request) -> JSONResponse:
        return JSONResponse({"detail": DETAIL}, status_code=503)

    return app


class StandbyAPI:
    """The standby app on the daemon's host and port, in a thread; `start()` and `stop()`."""

    def __init__(self, host: str, port: int, cert: tls.CertPair | None = None):
        self.cert = cert
        self.url = f"{'https' if cert else 'http'}://{host}:{port}"
        config = server_config(create_standby_app(), host, port)
        if cert is not None:
            config.ssl_certfile, config.ssl_keyfile = cert.certfile, cert.keyfile
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="standby-api", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.server.started:  # else (port taken): the standby waits all the same, unheard
            auth.load_or_create_token()  # the host's operator token, which spotctl here sends
            discovery.write_daemon_info(self.url, self.cert.certfile if self.cert else None)

    def stop(self) -> None:
        """Free the port for the leader's API (daemon.json stays: the leader rewrites it)."""
        self.server.should_exit = True
        self._thread.join(timeout=10)
