"""The CLI's side of the daemon API: find (or start) the daemon, call it with the token.

The daemon writes `daemon.json` (pid, url) into the state directory when it starts; the CLI
reads it, checks /v1/health, and otherwise starts `spotctl daemon` in the background.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from orchestrator.control import auth

from orchestrator.common import paths

from orchestrator.common import procs
from orchestrator.common.errors import UserError

# 0 = any free port (tests run several daemons side by side).
DEFAULT_PORT = int(os.environ.get("SPOT_ORCHESTRATOR_DAEMON_PORT", "8470"))


def daemon_info_path() -> Path:
    return paths.home() / "daemon.json"


def read_daemon_info() -> dict[str, Any] | None:
    try:
        return json.loads(daemon_info_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def running_daemon_url() -> str | None:
    info = read_daemon_info()
    if not info or not procs.pid_alive(int(info.get("pid", 0))):
        return None
    try:
        r = httpx.get(f"{info['url']}/v1/health", timeout=2.0)
        return info["url"] if r.status_code == 200 else None
    except httpx.TimeoutException:
        # Its process is alive and its port did not refuse: a daemon busy for a moment on a
        # loaded machine, not a missing one (and `up` must not start a second one beside it).
        return info["url"]
    except httpx.HTTPError:
        return None


def start_daemon_in_background(port: int | None = None, wait_s: float = 60.0) -> str:
    """Start `spotctl daemon` detached (its own session, output to the daemon log)."""
    log = paths.logs_dir() / "daemon.log"
    cmd = [sys.executable, "-m", "orchestrator.control.daemon"]
    cmd += ["--port", str(DEFAULT_PORT if port is None else port)]
    with open(log, "ab") as out:
        subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        url = running_daemon_url()
        if url:
            return url
        time.sleep(0.2)
    raise UserError(f"the daemon did not start within {wait_s:.0f}s; see {log}")


class DaemonClient:
    """Thin HTTP client; every error becomes one line (UserError)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token or auth.read_token() or ""
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers={"Authorization": f"Bearer {self.token}"})

    @classmethod
    def connect(cls, start: bool = False) -> DaemonClient:
        url = running_daemon_url()
        if url is None:
            if not start:
                raise UserError("no daemon is running; start one with `spotctl daemon` (or `spotctl up` starts it)")
            url = start_daemon_in_background()
        return cls(url)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise UserError(f"daemon at {self.url} unreachable: {err}") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise UserError(str(detail) if r.status_code < 500 else f"daemon error ({r.status_code}): {detail}")
        return r.json() if r.content else None

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw: Any) -> Any:
        return self.request("POST", path, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("DELETE", path, **kw)

    def stream_lines(self, path: str, **kw: Any):
        with self._http.stream("GET", path, timeout=None, **kw) as r:
            if r.status_code >= 400:
                r.read()
                raise UserError(r.json().get("detail", r.text))
            yield from r.iter_lines()
