"""Log level and log files of the long-running programs (the daemon, its load balancers).

The level comes from SPOT_ORCHESTRATOR_LOG_LEVEL (`spotctl --log-level` sets it for the daemon it
starts); the daemon logs to <state>/logs/daemon.log and the load balancers to <state>/logs/lb.log
(`spotctl logs --daemon` / `--lb` read them). Called by control.daemon.serve."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from orchestrator.common import paths
from orchestrator.common.errors import UserError

LEVEL_ENV = "SPOT_ORCHESTRATOR_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def level_name(value: str | None = None) -> str:
    """The level asked for (argument, else the environment, else info); UserError when unknown."""
    name = (value or os.environ.get(LEVEL_ENV) or "info").strip().lower()
    if name not in LEVELS:
        source = "--log-level" if value else LEVEL_ENV
        raise UserError(f"{source} {name!r}: expected one of {', '.join(LEVELS)}")
    return name


def daemon_log() -> Path:
    return paths.logs_dir() / "daemon.log"


def lb_log(service: str | None = None) -> Path:
    """A load balancer's log: its own file when it runs as its own process, else the shared one."""
    own = paths.logs_dir() / f"lb-{service}.log" if service else None
    return own if own is not None and own.exists() else paths.logs_dir() / "lb.log"


def _same_file(stream, path: Path) -> bool:
    # A daemon started in the background already has its output redirected to daemon.log;
    # a second handler on the same file would write every line twice.
    try:
        a, b = os.fstat(stream.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def configure_daemon(level: str | None = None) -> None:
    """Root logging for the daemon: stderr, daemon.log (unless stderr is it), lb.log for orchestrator.lb."""
    numeric = getattr(logging, level_name(level).upper())
    formatter = logging.Formatter(FORMAT)
    root = logging.getLogger()
    root.setLevel(numeric)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    log_file = daemon_log()
    if not _same_file(sys.stderr, log_file):
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    lb_handler = logging.FileHandler(paths.logs_dir() / "lb.log")
    lb_handler.setFormatter(formatter)
    logging.getLogger("orchestrator.lb").addHandler(lb_handler)
    # Their debug lines are every connection's steps (the data plane's admin calls every probe
    # pass among them): at debug they would bury the daemon's own lines.
    for noisy in ("apscheduler", "httpcore"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))
