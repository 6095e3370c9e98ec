"""Databases made before migrations existed (SQLModel's create_all, no alembic_version table):
which revision their tables match, for migrations.upgrade() to stamp, and the checks the
revisions of that era (0002-0004) use to skip what such a database already has.

create_all made missing tables on every start but never missing columns, so a database can
have a later table without an earlier column: the stamp is the last revision of the longest
run that is fully present, and the revisions after it skip whatever is there already.
"""

from __future__ import annotations

from sqlalchemy import inspect
from sqlalchemy.engine import Connection


def has_table(conn: Connection, table: str) -> bool:
    return inspect(conn).has_table(table)


def has_column(conn: Connection, table: str, column: str) -> bool:
    inspector = inspect(conn)
    return inspector.has_table(table) and column in {c["name"] for c in inspector.get_columns(table)}


# What each pre-migration revision added: a table, or a column of one. Closed: every database
# is stamped from 0004 on, so a later revision never needs a line here.
_MARKS = [
    ("0001", "services", None),
    ("0002", "replicas", "control_endpoint"),
    ("0003", "bootstrap_tokens", None),
    ("0004", "services", "incarnation"),
]


def revision(conn: Connection) -> str | None:
    """The revision to stamp an unversioned database at; None when it has none of our tables."""
    found = None
    for rev, table, column in _MARKS:
        if not (has_column(conn, table, column) if column else has_table(conn, table)):
            break
        found = rev
    return found
