"""Where the running daemon is: the `daemon.json` file in the state directory (pid, url).

The daemon writes it when its API listens (`write_daemon_info`) and removes it at exit; the
CLI reads it and checks /v1/health (`running_daemon_url`), and starts a daemon in the
background when none answers (`start_daemon_in_background`).
"""

from __future__ import annotations

import fcntl
import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from orchestrator.common import paths, procs
from orchestrator.common.errors import RuntimeFailure
from orchestrator.control import tls


class DaemonStartFailed(RuntimeFailure):
    """The daemon spotctl started exited with an error (e.g. a lost state database)."""


# 0 = any free port (tests run several daemons side by side).
DEFAULT_PORT = int(os.environ.get("SPOT_ORCHESTRATOR_DAEMON_PORT", "8470"))


def daemon_info_path() -> Path:
    return paths.home() / "daemon.json"


def daemon_lock_path() -> Path:
    """The lock the running daemon holds (orchestrator.control.daemon.hold_state_lock)."""
    return paths.home() / "daemon.lock"


def lock_held() -> bool:
    """Whether a daemon holds this state directory's lock (running, or starting up)."""
    try:
        with open(daemon_lock_path(), "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


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
        r = httpx.get(f"{info['url']}/v1/health", timeout=2.0, verify=tls.client_context(info.get("cafile")))
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
        start = out.tell()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        url = running_daemon_url()
        if url:
            return url
        # Ours exited: another one beside it (a concurrent `spotctl`) holds the lock and is
        # starting, or ours failed, and then its one-line error is the user's.
        if proc.poll() is not None and not lock_held():
            raise DaemonStartFailed(_last_error(log, start) or f"the daemon exited ({proc.returncode}); see {log}")
        time.sleep(0.2)
    raise RuntimeFailure(f"the daemon did not start within {wait_s:.0f}s; see {log}")


def _last_error(log: Path, start: int) -> str | None:
    with open(log, "rb") as fh:
        fh.seek(start)
        lines = fh.read().decode(errors="replace").splitlines()
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    return errors[-1] if errors else None


def local_url(url: str) -> str:
    """The URL this machine's CLI uses: a daemon bound to every address is reached on loopback."""
    return url.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")


def verify() -> ssl.SSLContext | bool:
    """How to verify the running daemon's TLS certificate (the one it recorded)."""
    info = read_daemon_info() or {}
    return tls.client_context(info.get("cafile"))


def write_daemon_info(url: str, cafile: str | None = None) -> None:
    """`cafile`: the API's certificate, which the CLI trusts for this daemon."""
    path = daemon_info_path()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "url": local_url(url), "cafile": cafile,
                               "started_at": time.time()}))
    os.replace(tmp, path)
