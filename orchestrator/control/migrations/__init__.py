"""Schema migrations of the state store (Alembic), not to be confused with control/migration.py
(moving replicas). Store() calls upgrade() on start; `spotctl db` calls current() and upgrade().

upgrade() brings a database to the newest revision in one transaction: an empty one gets every
table, one made before migrations existed (tables, no alembic_version) is stamped at the revision
its columns show (legacy.py) first, and one at a revision this code does not know (made by a newer
spot-orchestrator) is refused with SchemaTooNew before anything is written. Revisions live in
versions/; docs/lifecycle.md ("Schema migrations") says how to add one.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

from orchestrator.common.errors import RuntimeFailure
from orchestrator.control.migrations import legacy

SCRIPT_LOCATION = Path(__file__).resolve().parent
# Any constant: the key of the PostgreSQL advisory lock that queues concurrent upgrades.
_PG_LOCK_KEY = 0x5B07_0001
# Alembic's `op` and `context` are module-wide proxies: two upgrades in one process (two
# stores in two threads) must not run their scripts at the same time.
_RUNNING = threading.Lock()


class SchemaTooNew(RuntimeFailure):
    """The database is at a revision this code does not know: a newer spot-orchestrator made it."""


def config(connection: Connection | None = None) -> Config:
    """Alembic's config for the package's scripts; env.py runs them on `connection`."""
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(config())


def head() -> str:
    return _scripts().get_current_head()


def known(revision: str) -> bool:
    return revision in {s.revision for s in _scripts().walk_revisions()}


def current(engine: Engine) -> str | None:
    """The database's recorded revision (None: empty, or made before migrations); writes nothing."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> tuple[str | None, str]:
    """Upgrade to head in one transaction; returns (the revision found, head). Raises
    SchemaTooNew, leaving the database untouched, for a revision newer than this code."""
    with engine.begin() as conn:
        _queue(conn)
        ctx = MigrationContext.configure(conn)
        found = ctx.get_current_revision()
        if found is None:
            found = legacy.revision(conn)
            if found is not None:
                ctx.stamp(_scripts(), found)
        elif not known(found):
            url = engine.url.render_as_string(hide_password=True)
            raise SchemaTooNew(f"the state database at {url} is at schema revision {found}, which this "
                               f"spot-orchestrator does not know (its newest is {head()}): a newer version "
                               "made it; upgrade spot-orchestrator")
        if found != head():
            with _RUNNING:
                command.upgrade(config(conn), "head")  # env.py: on conn, inside this transaction
    return found, head()


def _queue(conn: Connection) -> None:
    """Make a second upgrader wait for this one's commit. SQLite needs nothing: the store's
    engine begins with BEGIN IMMEDIATE, which already holds the write lock."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK_KEY})")
