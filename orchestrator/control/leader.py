"""Leadership of one state database: which of the daemons sharing it reconciles and launches.

`serve()` (orchestrator.control.daemon) calls `Leadership(url).wait(poll_s, on_wait)` before it
restores services or starts any job. On PostgreSQL the leader holds a session-level advisory
lock on one dedicated connection (not the store's pool: a pooled connection is returned and
reused, and the lock would go with it) for the life of the process; a standby polls for it
every `SPOT_ORCHESTRATOR_LEADER_POLL_S` seconds. Once held, a watchdog pings that connection at
the same period: should it drop, the lock is gone and another daemon may lead, so `on_lost`
runs (the daemon's: log an error and exit non-zero, so systemd restarts it as a standby).

SQLite and any other dialect: a no-op, held at once (the state directory's file lock,
daemon.hold_state_lock, already means one daemon per database file).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.pool import NullPool

log = logging.getLogger(__name__)

POLL_ENV = "SPOT_ORCHESTRATOR_LEADER_POLL_S"
DEFAULT_POLL_S = 2.0
# A constant derived from a name (a signed 64-bit key), distinct from the schema migrations' key
# (orchestrator.control.migrations._PG_LOCK_KEY): an upgrade under a leader must not wait on it.
LOCK_NAME = "spot-orchestrator:leader"
LOCK_KEY = int.from_bytes(hashlib.sha256(LOCK_NAME.encode()).digest()[:8], "big", signed=True)


def poll_s() -> float:
    return float(os.environ.get(POLL_ENV, DEFAULT_POLL_S))


def display_url(url: str) -> str:
    """The database URL as logs show it: without its password."""
    return make_url(url).render_as_string(hide_password=True)


def _exit_on_loss(reason: str) -> None:
    log.error("leadership of the state database lost (%s); exiting so a restart waits as a standby", reason)
    os._exit(3)  # now, from the watchdog thread: no job may run one more pass without the lock


class Leadership:
    """The leader lock of the database at `url`. `try_acquire()` once, or `wait()` until held;
    `held()`; `close()` releases it (closing its connection)."""

    def __init__(self, url: str, on_lost: Callable[[str], None] = _exit_on_loss):
        self.url = url
        self.on_lost = on_lost
        self.exclusive = make_url(url).get_backend_name() == "postgresql"
        self._engine = create_engine(url, poolclass=NullPool) if self.exclusive else None
        self._conn: Connection | None = None
        self._held = not self.exclusive
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    def held(self) -> bool:
        return self._held

    def try_acquire(self) -> bool:
        """Take the lock if it is free; True when this process leads."""
        if self._held:
            return True
        if self._conn is None:
            self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        if self._conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY}).scalar():
            self._held = True
            self._watchdog = threading.Thread(target=self._watch, name="leader-watchdog", daemon=True)
            self._watchdog.start()
        return self._held

    def wait(self, poll: float | None = None, on_wait: Callable[[], None] | None = None) -> None:
        """Block until held; `on_wait()` once if it is not at the first try."""
        poll = poll_s() if poll is None else poll
        if self.try_acquire():
            return
        if on_wait is not None:
            on_wait()
        while not self._stop.wait(poll):
            try:
                if self.try_acquire():
                    return
            except Exception as err:  # the database away for a moment: a standby just tries again
                log.warning("standby: asking for the leader lock failed: %s", str(err).splitlines()[0])
                self._drop_connection()

    def _watch(self) -> None:
        while not self._stop.wait(poll_s()):
            try:
                self._conn.execute(text("SELECT 1"))
            except Exception as err:
                if self._stop.is_set():  # closed meanwhile: nothing was lost
                    return
                self._held = False
                self.on_lost(str(err).splitlines()[0] if str(err) else type(err).__name__)
                return

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # already broken: closing it is all that was wanted
                pass
            self._conn = None

    def close(self) -> None:
        """Release the lock (its session ends) and stop the watchdog."""
        self._stop.set()
        self._held = not self.exclusive
        self._drop_connection()
        if self._engine is not None:
            self._engine.dispose()
