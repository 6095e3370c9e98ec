"""The data plane: every service's load balancer in one process that outlives the daemon.

    python -m orchestrator.lb.dataplane        (the daemon starts it: orchestrator.control.dataplane)

One process per state directory (`dataplane.lock`), started detached by the daemon, so that a
daemon that crashes, restarts or is upgraded cuts no client stream: each LoadBalancer keeps
serving on its service's port with the last replica set it was given. The daemon drives it over
a small admin API on a loopback port (orchestrator.lb.admin), with the bearer token in
`<state>/dataplane.token` (0600); where it listens is in `<state>/dataplane.json` (pid, url).
It exits once it hosts no load balancer (the last service went down), and on SIGTERM.
docs/architecture.md ("The data plane") has the protocol and what each process's death does.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

from orchestrator.common import paths
from orchestrator.common.errors import UserError, exit_code_of

log = logging.getLogger(__name__)

# A data plane started and never given a load balancer (its daemon died at once) goes away.
UNUSED_EXIT_S = float(os.environ.get("SPOT_ORCHESTRATOR_DATAPLANE_UNUSED_S", "60"))
LOCK_WAIT_S = 15.0  # a data plane that is exiting still holds the lock for a moment


def record_path() -> Path:
    return paths.home() / "dataplane.json"


def token_path() -> Path:
    return paths.home() / "dataplane.token"


def lock_path() -> Path:
    return paths.home() / "dataplane.lock"


def read_record() -> dict | None:
    """The running data plane's record ({pid, url, started_at}), None when there is none."""
    try:
        return json.loads(record_path().read_text())
    except (OSError, ValueError):
        return None


def load_or_create_token() -> str:
    """The admin API's bearer token; made (0600) on first use, by whichever side comes first."""
    path = token_path()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


def _hold_lock():
    """This state directory's data-plane lock (held for the life of the process); UserError
    when another data plane keeps it past LOCK_WAIT_S."""
    fh = open(lock_path(), "a+")
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                fh.close()
                raise UserError(f"a data plane already runs for the state in {paths.home()}") from None
            time.sleep(0.1)
    fh.truncate(0)
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def _write_record(url: str) -> None:
    tmp = record_path().with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "url": url, "started_at": time.time()}))
    os.replace(tmp, record_path())


def _remove_record() -> None:
    record = read_record()
    if record and record.get("pid") == os.getpid():
        record_path().unlink(missing_ok=True)


def serve() -> None:
    """Run the data plane until it hosts nothing or gets SIGTERM (then its LBs stop first)."""
    from orchestrator.lb.admin import DataPlane, create_app

    lock = _hold_lock()  # noqa: F841 - held for the life of the process
    plane = DataPlane()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(plane, load_or_create_token()), log_level="warning",
                                           access_log=False, lifespan="off"))
    plane.on_empty = lambda: setattr(server, "should_exit", True)
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        _write_record(url)
        log.info("data plane listening on %s (pid %d, state in %s)", url, os.getpid(), paths.home())
        plane.exit_if_unused(UNUSED_EXIT_S)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        _remove_record()
        plane.stop_all()
        log.info("data plane exited")


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m orchestrator.lb.dataplane",
                            description="every service's load balancer (the daemon starts it)").parse_args(argv)
    level = os.environ.get("SPOT_ORCHESTRATOR_LOG_LEVEL", "info").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return exit_code_of(serve)


if __name__ == "__main__":
    sys.exit(main())
