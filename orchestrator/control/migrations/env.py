"""Alembic's environment for the state store's revisions (versions/). migrations.upgrade() runs
it on the connection it passes in its own transaction; the `alembic` command (alembic.ini beside
this file, for `alembic revision --autogenerate`) runs it on $SPOT_ORCHESTRATOR_DB_URL's database.
"""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

from orchestrator.control import store  # registers the tables on SQLModel.metadata


def _run(connection) -> None:
    # render_as_batch: SQLite can ALTER little in place; batch ops copy the table when needed.
    context.configure(connection=connection, target_metadata=SQLModel.metadata, render_as_batch=True)
    with context.begin_transaction():  # no-op inside migrations.upgrade()'s transaction
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("the state store's migrations run online only (no --sql)")
_connection = context.config.attributes.get("connection")
if _connection is not None:
    _run(_connection)
else:
    with store.make_engine(store.default_url()).begin() as _conn:
        _run(_conn)
