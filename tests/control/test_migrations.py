"""The state store's schema migrations on real SQLite files: the first shipped schema and
pre-migration (create_all) databases upgrade keeping their rows, a newer database is refused
untouched, the revisions build exactly the tables the code declares, `spotctl db` works."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlmodel import SQLModel

from orchestrator.control import migrations
from orchestrator.control.migrations import SchemaTooNew, legacy
from orchestrator.control.store import Store, make_engine
from providers.base import Market
from tests.fakes.postgres import fresh_db
from tests.helpers import REPO, free_port, spotctl

HEAD = migrations.head()

# The tables as the first commit's create_all made them (orchestrator/state.py of c0b7dcf):
# no services.incarnation, no replicas.control_endpoint, no bootstrap_tokens.
FIRST_SCHEMA = """
CREATE TABLE services (
    name VARCHAR NOT NULL, spec_json VARCHAR NOT NULL, status VARCHAR NOT NULL, endpoint VARCHAR,
    lb_port INTEGER, next_replica_index INTEGER NOT NULL, created_at FLOAT NOT NULL,
    updated_at FLOAT NOT NULL, version INTEGER NOT NULL, PRIMARY KEY (name));
CREATE TABLE events (
    id INTEGER NOT NULL, at FLOAT NOT NULL, service VARCHAR, replica_id VARCHAR, kind VARCHAR NOT NULL,
    cloud VARCHAR, region VARCHAR, zone VARCHAR, market VARCHAR, message VARCHAR NOT NULL,
    data_json VARCHAR NOT NULL, PRIMARY KEY (id));
CREATE INDEX ix_events_at ON events (at);
CREATE INDEX ix_events_service_at ON events (service, at);
CREATE TABLE price_quotes (
    id INTEGER NOT NULL, cloud VARCHAR NOT NULL, region VARCHAR NOT NULL, zone VARCHAR NOT NULL,
    instance_type VARCHAR NOT NULL, accelerator VARCHAR NOT NULL, accelerator_count INTEGER NOT NULL,
    market VARCHAR NOT NULL, price_per_hour FLOAT NOT NULL, observed_at FLOAT NOT NULL, PRIMARY KEY (id));
CREATE INDEX ix_price_quotes_lookup ON price_quotes (cloud, zone, instance_type, observed_at);
CREATE TABLE locations (
    cloud VARCHAR NOT NULL, region VARCHAR NOT NULL, zone VARCHAR NOT NULL, spot_price FLOAT,
    on_demand_price FLOAT, updated_at FLOAT NOT NULL, PRIMARY KEY (cloud, region, zone));
CREATE TABLE replicas (
    replica_id VARCHAR NOT NULL, service VARCHAR NOT NULL, "index" INTEGER NOT NULL, state VARCHAR NOT NULL,
    cloud VARCHAR NOT NULL, region VARCHAR NOT NULL, zone VARCHAR NOT NULL, market VARCHAR NOT NULL,
    instance_type VARCHAR, instance_id VARCHAR, endpoint VARCHAR, agent_endpoint VARCHAR,
    price_per_hour FLOAT, created_at FLOAT NOT NULL, launched_at FLOAT, ready_at FLOAT,
    notice_deadline FLOAT, consecutive_probe_failures INTEGER NOT NULL, first_probe_at FLOAT,
    last_probe_ok_at FLOAT, status_message VARCHAR NOT NULL, updated_at FLOAT NOT NULL,
    version INTEGER NOT NULL, PRIMARY KEY (replica_id),
    CONSTRAINT uq_replica_service_index UNIQUE (service, "index"),
    FOREIGN KEY(service) REFERENCES services (name));
CREATE INDEX ix_replicas_service ON replicas (service);
"""



def _rows(incarnation: bool = False) -> str:
    """A service, one of its replicas and an event; `incarnation`: the table has that column
    (create_all made it NOT NULL without a default), filled as the old patch did ('')."""
    columns = "name, spec_json, status, endpoint, lb_port, next_replica_index, created_at, updated_at, version"
    values = "'chat', '{\"name\": \"chat\"}', 'READY', 'http://lb:8080', 8080, 3, 1.0, 2.0, 4"
    if incarnation:
        columns, values = f"{columns}, incarnation", f"{values}, ''"
    return f"""
        INSERT INTO services ({columns}) VALUES ({values});
        INSERT INTO replicas (replica_id, service, "index", state, cloud, region, zone, market, instance_id,
            endpoint, created_at, consecutive_probe_failures, status_message, updated_at, version)
            VALUES ('chat-2', 'chat', 2, 'READY', 'local', 'local', 'local-a', 'spot', 'i-1', 'http://r:1', 1.0,
                    0, 'ready', 2.0, 5);
        INSERT INTO events (at, service, kind, message, data_json) VALUES (1.5, 'chat', 'launch', 'launched', '{{}}');
    """


def _sqlite(path: Path, script: str) -> None:
    with sqlite3.connect(path) as db:
        db.executescript(script)
    db.close()


def _url(path: Path) -> str:
    return f"sqlite:///{path}"


def _differences(engine) -> list:
    """What alembic's autogenerate would add to make the database match SQLModel.metadata."""
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)


def _revision(path: Path) -> str | None:
    with sqlite3.connect(path) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        revision = db.execute("SELECT version_num FROM alembic_version").fetchone()[0] \
            if "alembic_version" in tables else None
    db.close()
    return revision


def _dump(path: Path) -> list[str]:
    with sqlite3.connect(path) as db:
        dump = list(db.iterdump())
    db.close()
    return dump


def _assert_first_rows_kept(store: Store) -> None:
    service = store.get_service("chat")
    assert (service.status, service.endpoint, service.next_replica_index, service.version) == \
        ("READY", "http://lb:8080", 3, 4)
    assert service.incarnation == ""  # rows from before incarnations existed
    replica = store.get_replica("chat-2")
    assert (replica.state, replica.instance_id, replica.control_endpoint, replica.version) == \
        ("READY", "i-1", None, 5)
    # Launched before revisions: unknown until the next update takes the stored spec's (0005).
    assert (replica.spec_revision, service.update_mode) == (None, None)
    assert store.fill_spec_revision("chat", "abc123") == 1
    assert store.get_replica("chat-2").spec_revision == "abc123"
    assert store.fill_spec_revision("chat", "def456") == 0  # a known revision is kept
    assert [e.message for e in store.list_events("chat")] == ["launched"]


def test_the_first_shipped_schema_upgrades_keeping_its_rows(tmp_path):
    path = tmp_path / "state.db"
    _sqlite(path, FIRST_SCHEMA + _rows())
    store = Store(_url(path))
    try:
        _assert_first_rows_kept(store)
        assert _revision(path) == HEAD
        assert _differences(store.engine) == []
        # The new columns and tables work through the API.
        row = store.update_replica("chat-2", 5, control_endpoint="http://r:2")
        assert row.control_endpoint == "http://r:2"
        added = store.add_replica("chat", cloud="local", region="local", zone="local-b", market=Market.SPOT)
        assert added.replica_id == "chat-3"
        store.add_bootstrap_token("h", "chat", "chat-3", expires_at=10.0)
        assert store.redeem_bootstrap_token("h") is True
    finally:
        store.close()


def _drop_column(path: Path, table: str, column: str) -> None:
    _sqlite(path, f"ALTER TABLE {table} DROP COLUMN {column};")


# Columns of revisions after migrations existed (0005 on): no create_all database had them.
AFTER_MIGRATIONS = [("replicas", "spec_revision"), ("services", "update_mode")]


def _create_all(path: Path) -> None:
    """A database as the last create_all (before migrations) made it: today's tables less the
    columns later revisions added."""
    engine = make_engine(_url(path))
    SQLModel.metadata.create_all(engine)
    engine.dispose()
    for table, column in AFTER_MIGRATIONS:
        _drop_column(path, table, column)


@pytest.mark.parametrize(("dropped", "stamp"), [
    ([], "0004"),  # create_all just before this change (and _add_missing_columns' incarnation)
    ([("services", "incarnation")], "0003"),  # before incarnations
    # Made by the first commit, later started by one with bootstrap tokens and incarnations:
    # create_all added the table, nothing added the column (the `no such column` failure).
    ([("replicas", "control_endpoint")], "0001"),
])
def test_a_database_made_by_create_all_is_stamped_and_upgraded(tmp_path, dropped, stamp):
    path = tmp_path / "state.db"
    _create_all(path)
    for table, column in dropped:
        _drop_column(path, table, column)
    _sqlite(path, _rows(incarnation=("services", "incarnation") not in dropped))
    engine = make_engine(_url(path))
    with engine.connect() as conn:
        assert legacy.revision(conn) == stamp
    engine.dispose()
    store = Store(_url(path))
    try:
        _assert_first_rows_kept(store)
        assert _revision(path) == HEAD
        assert _differences(store.engine) == []
    finally:
        store.close()


def test_a_database_of_a_newer_version_is_refused_untouched(tmp_path, state_home):
    path = state_home / "state.db"
    Store(_url(path)).close()
    _sqlite(path, "UPDATE alembic_version SET version_num = '9999_from_the_future';" + _rows(incarnation=True))
    before = _dump(path)
    with pytest.raises(SchemaTooNew) as err:
        Store(_url(path))
    message = str(err.value)
    assert "\n" not in message and "9999_from_the_future" in message and "upgrade spot-orchestrator" in message
    assert err.value.exit_code == 1
    assert _dump(path) == before
    # The daemon refuses it in one line too (serve() prints UserErrors as `error: ...`).
    proc = subprocess.run([sys.executable, "-m", "orchestrator.control.daemon", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and errors == [f"error: {message}"], proc.stderr
    cli = spotctl("db", "upgrade", check=False)
    assert (cli.returncode, cli.stderr.strip()) == (1, f"error: {message}")
    assert _dump(path) == before


def test_migrations_build_exactly_the_declared_tables(tmp_path):
    """The check that fails when a table or column is added without a revision."""
    engine = make_engine(_url(tmp_path / "state.db"))
    try:
        assert migrations.upgrade(engine) == (None, HEAD)
        assert _differences(engine) == []
        assert migrations.upgrade(engine) == (HEAD, HEAD)  # idempotent
    finally:
        engine.dispose()


def test_migrations_build_exactly_the_declared_tables_on_postgres(postgres_server):
    url = fresh_db(postgres_server)
    store = Store(url)
    try:
        assert migrations.current(store.engine) == HEAD
        assert _differences(store.engine) == []
        Store(url).close()  # a second start finds it at head
    finally:
        store.close()


def test_concurrent_starts_upgrade_once(tmp_path):
    """Processes opening one old database at once: one upgrades, the others wait and find it done."""
    path = tmp_path / "state.db"
    _sqlite(path, FIRST_SCHEMA + _rows())
    code = textwrap.dedent(f"""
        from orchestrator.control.store import Store
        store = Store({_url(path)!r})
        print(store.get_service("chat").version)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(p.wait(timeout=120), p.stdout.read().strip(), p.stderr.read()) for p in procs]
    assert [(rc, out) for rc, out, _ in results] == [(0, "4")] * 3, results
    assert _revision(path) == HEAD


def test_spotctl_db_upgrade_and_current(state_home):
    fresh = json.loads(spotctl("db", "current", "--json").stdout)
    url = f"sqlite:///{state_home / 'state.db'}"
    assert fresh == {"url": url, "revision": None, "head": HEAD, "up_to_date": False, "known": True}
    assert not (state_home / "state.db").exists()  # reading created nothing
    _sqlite(state_home / "state.db", FIRST_SCHEMA + _rows())
    out = spotctl("db", "upgrade").stdout.strip()
    assert out == f"state database at {url}: revision {HEAD} (head; was 0001)"
    assert spotctl("db", "upgrade").stdout.strip() == f"state database at {url}: revision {HEAD} (head)"
    assert json.loads(spotctl("db", "current", "--json").stdout) == \
        {"url": url, "revision": HEAD, "head": HEAD, "up_to_date": True, "known": True}
    assert spotctl("db", "current").stdout.strip() == f"state database at {url}: revision {HEAD} (head)"
    store = Store(url)
    try:
        _assert_first_rows_kept(store)
    finally:
        store.close()
