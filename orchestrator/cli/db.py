"""`spotctl db`: the state database's schema revision (`current`) and bringing it to this
version's (`upgrade`), without the daemon. Works on the store's database (default_url(): the
state home's state.db, or $SPOT_ORCHESTRATOR_DB_URL); upgrading is idempotent and safe beside a
running daemon (one transaction, which a concurrent upgrader waits for).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import typer
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from orchestrator.common.errors import RuntimeFailure, UserError
from orchestrator.control import migrations
from orchestrator.control.store import default_url, make_engine

db_app = typer.Typer(help="The state database's schema: its revision, and upgrading it.", no_args_is_help=True)


def _url() -> str:
    """The store's database URL; one that does not parse is the user's error."""
    url = default_url()
    try:
        make_url(url)
    except ArgumentError as err:
        raise UserError(f"state database URL {url!r}: {err}") from None
    return url


def _shown(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def _missing_file(url: str) -> bool:
    """A SQLite database that does not exist yet (reading it must not create it)."""
    parsed = make_url(url)
    return parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:") \
        and not Path(parsed.database).expanduser().exists()


@contextlib.contextmanager
def _engine(url: str) -> Iterator[Engine]:
    """The database's engine; a bad URL is the user's error, a database that fails, a runtime one."""
    try:
        engine = make_engine(url)
    except ArgumentError as err:  # e.g. a dialect or driver that is not installed
        raise UserError(f"state database URL {_shown(url)}: {err}") from None
    try:
        yield engine
    except SQLAlchemyError as err:
        reason = str(getattr(err, "orig", None) or err).splitlines()[0]
        raise RuntimeFailure(f"state database at {_shown(url)}: {reason}") from None
    finally:
        engine.dispose()


@db_app.command("current")
def current(as_json: bool = typer.Option(False, "--json", help="Print a JSON object.")) -> None:
    """Print the database's schema revision and whether it is this version's newest."""
    url, head = _url(), migrations.head()
    if _missing_file(url):
        revision = None
    else:
        with _engine(url) as engine:
            revision = migrations.current(engine)
    known = revision is None or migrations.known(revision)
    if as_json:
        typer.echo(json.dumps({"url": _shown(url), "revision": revision, "head": head,
                               "up_to_date": revision == head, "known": known}))
        return
    if revision == head:
        note = "head"
    elif not known:
        note = f"unknown to this spot-orchestrator, whose newest is {head}: upgrade spot-orchestrator"
    else:
        note = f"head is {head}; `spotctl db upgrade` or the daemon's next start upgrades it"
    typer.echo(f"state database at {_shown(url)}: revision {revision or 'none'} ({note})")


@db_app.command("upgrade")
def upgrade(as_json: bool = typer.Option(False, "--json", help="Print a JSON object.")) -> None:
    """Upgrade the database's schema to this version's newest (idempotent; keeps every row)."""
    url = _url()
    with _engine(url) as engine:
        previous, head = migrations.upgrade(engine)
    if as_json:
        typer.echo(json.dumps({"url": _shown(url), "revision": head, "head": head, "previous": previous}))
        return
    was = "" if previous == head else f"; was {previous or 'empty'}"
    typer.echo(f"state database at {_shown(url)}: revision {head} (head{was})")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
