"""The state store: sqlmodel tables and the engine (SQLite by default, any SQLAlchemy URL).

All control-plane state lives here (the daemon, its controllers, the migrator and the API use
it), so the daemon can crash and restart without losing anything. Default database:
`sqlite:///<paths.home()>/state.db` (WAL, busy timeout, foreign keys on); `SPOT_ORCHESTRATOR_DB_URL`
or `Store(url)` selects another (e.g. PostgreSQL). Writes are transactional: `with
store.transaction() as tx:` offers every Store method on `tx`, all or nothing; called on the
store itself, a method runs in a transaction of its own. Returned rows are detached table
objects: plain values to read; changing an attribute writes nothing (use the update_* methods).
`update_replica(id, expected_version, **fields)` raises ConflictError when another writer got
there first, and IllegalTransition for a state change orchestrator.fleet.lifecycle does not allow
(an allowed one is recorded as a "transition" event in the same transaction). Store() brings the
database's schema up to this code's first (orchestrator.control.migrations).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import json
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Index, UniqueConstraint, event, func, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.pool import StaticPool
from sqlmodel import Field, Session, SQLModel, col, create_engine, delete, select

from orchestrator.common import paths
from orchestrator.control import migrations
from orchestrator.fleet.lifecycle import TERMINAL_STATES, ReplicaState, transition
from providers.base import Location, Market, Offer

DB_URL_ENV = "SPOT_ORCHESTRATOR_DB_URL"


class StateError(Exception):
    """Base class of the store's errors."""


class ConflictError(StateError):
    """An update carried a stale version: re-read the row and decide again."""


class RowNotFound(StateError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class ServiceStatus:
    """Service status values (SkyServe's names); the controller derives them from replicas."""

    PENDING = "PENDING"  # created, no replica launched yet
    REPLICA_INIT = "REPLICA_INIT"  # replicas launching, none ready
    READY = "READY"  # at least one replica ready
    NO_REPLICA = "NO_REPLICA"  # was ready, none is now
    FAILED = "FAILED"  # gave up (e.g. every launch failed)
    SHUTTING_DOWN = "SHUTTING_DOWN"  # `down` in progress: replicas terminating, rows go next


def _now() -> float:
    return time.time()


class ServiceRow(SQLModel, table=True):
    __tablename__ = "services"

    name: str = Field(primary_key=True)
    spec_json: str
    status: str = ServiceStatus.PENDING
    endpoint: str | None = None
    lb_port: int | None = None
    next_replica_index: int = 1  # replica ids are never reused, even after deletion
    # Which `up` of the service this is: new whenever the row is created (a service that was
    # not running), kept by updates. Its machines carry it in their tags (providers.base).
    incarnation: str = Field(default_factory=lambda: secrets.token_hex(4))
    # The update in progress ("rolling" | "blue-green", orchestrator.fleet.rollout); None: none.
    update_mode: str | None = None
    created_at: float = Field(default_factory=_now)
    updated_at: float = Field(default_factory=_now)
    version: int = 1


class ReplicaRow(SQLModel, table=True):
    __tablename__ = "replicas"
    __table_args__ = (UniqueConstraint("service", "index", name="uq_replica_service_index"),)

    replica_id: str = Field(primary_key=True)  # "<service>-<index>"
    service: str = Field(foreign_key="services.name", index=True)
    index: int
    state: str = ReplicaState.PENDING.value
    cloud: str
    region: str
    zone: str
    market: str  # providers.base.Market value
    instance_type: str | None = None
    instance_id: str | None = None
    endpoint: str | None = None
    agent_endpoint: str | None = None
    control_endpoint: str | None = None  # the KV connector's flush endpoint
    price_per_hour: float | None = None
    created_at: float = Field(default_factory=_now)
    launched_at: float | None = None
    ready_at: float | None = None
    notice_deadline: float | None = None
    consecutive_probe_failures: int = 0
    first_probe_at: float | None = None
    last_probe_ok_at: float | None = None
    status_message: str = ""
    # The launch revision of the spec it was launched from (orchestrator.spec.revision); None:
    # launched by a daemon from before revisions.
    spec_revision: str | None = None
    updated_at: float = Field(default_factory=_now)
    version: int = 1

    @property
    def replica_state(self) -> ReplicaState:
        return ReplicaState(self.state)

    @property
    def location(self) -> Location:
        return Location(self.cloud, self.region, self.zone)

    @property
    def market_enum(self) -> Market:
        return Market(self.market)


class EventRow(SQLModel, table=True):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_service_at", "service", "at"),)

    id: int | None = Field(default=None, primary_key=True)
    at: float = Field(default_factory=_now, index=True)
    service: str | None = None  # None for market-wide events
    replica_id: str | None = None
    kind: str  # e.g. "transition", "launch", "notice", "preempted", "capacity_error"
    cloud: str | None = None
    region: str | None = None
    zone: str | None = None
    market: str | None = None
    message: str = ""
    data_json: str = "{}"


class PriceQuote(SQLModel, table=True):
    __tablename__ = "price_quotes"
    __table_args__ = (Index("ix_price_quotes_lookup", "cloud", "zone", "instance_type", "observed_at"),)

    id: int | None = Field(default=None, primary_key=True)
    cloud: str
    region: str
    zone: str
    instance_type: str
    accelerator: str
    accelerator_count: int
    market: str
    price_per_hour: float
    observed_at: float = Field(default_factory=_now)


class LocationRow(SQLModel, table=True):
    __tablename__ = "locations"

    cloud: str = Field(primary_key=True)
    region: str = Field(primary_key=True)
    zone: str = Field(primary_key=True)
    spot_price: float | None = None  # cheapest latest quote
    on_demand_price: float | None = None
    updated_at: float = Field(default_factory=_now)

    @property
    def location(self) -> Location:
        return Location(self.cloud, self.region, self.zone)


class BootstrapTokenRow(SQLModel, table=True):
    """A VM's one-time boot credential (orchestrator.control.bootstrap): only its hash is kept."""

    __tablename__ = "bootstrap_tokens"

    token_hash: str = Field(primary_key=True)
    service: str = Field(index=True)
    replica_id: str = Field(index=True)
    created_at: float = Field(default_factory=_now)
    expires_at: float
    redeemed_at: float | None = None


# ---- operations ---------------------------------------------------------------------

_SERVICE_FIELDS = frozenset({"spec_json", "status", "endpoint", "lb_port", "update_mode"})
_REPLICA_FIELDS = frozenset(ReplicaRow.model_fields) - {
    "replica_id",
    "service",
    "index",
    "version",
    "created_at",
}
_TERMINAL_VALUES = tuple(s.value for s in TERMINAL_STATES)
# Tables a fleet snapshot (orchestrator.control.snapshot) does not hold.
_UNSNAPSHOTTED_TABLES = frozenset({"events", "price_quotes", "locations", "bootstrap_tokens"})


class _Ops:
    """The store's operations, written once. `_scope()` yields the session to use: the
    Store opens (and commits) one per call, a Tx hands out its own."""

    def _scope(self) -> contextlib.AbstractContextManager[Session]:
        raise NotImplementedError

    def _read_scope(self) -> contextlib.AbstractContextManager[Session]:
        """The session of an operation that only reads (a Tx: its own; the Store: a read
        transaction, which on SQLite takes no write lock)."""
        return self._scope()

    # ---- services -----------------------------------------------------------------

    def create_or_update_service(
        self,
        name: str,
        spec_json: str,
        *,
        status: str | None = None,
        endpoint: str | None = None,
        lb_port: int | None = None,
    ) -> ServiceRow:
        """Insert the service, or replace its spec (bumping version); other fields given
        are set, the rest kept."""
        with self._scope() as s:
            row = s.get(ServiceRow, name)
            if row is None:
                row = ServiceRow(name=name, spec_json=spec_json, status=status or ServiceStatus.PENDING)
            else:
                row.spec_json = spec_json
                row.version += 1
                row.updated_at = _now()
                if status is not None:
                    row.status = status
            if endpoint is not None:
                row.endpoint = endpoint
            if lb_port is not None:
                row.lb_port = lb_port
            s.add(row)
            s.flush()
            return row

    def get_service(self, name: str) -> ServiceRow | None:
        with self._read_scope() as s:
            return s.get(ServiceRow, name)

    def list_services(self) -> list[ServiceRow]:
        with self._read_scope() as s:
            return list(s.exec(select(ServiceRow).order_by(ServiceRow.name)))

    def update_service(self, name: str, expected_version: int | None = None, **fields: Any) -> ServiceRow:
        """Set fields (status, endpoint, lb_port, spec_json, update_mode); with expected_version, refuse
        (ConflictError) when the row moved on. Bumps version."""
        _check_fields("service", fields, _SERVICE_FIELDS)
        with self._scope() as s:
            return _versioned_update(s, ServiceRow, ServiceRow.name, name, expected_version, fields)

    def delete_service(self, name: str) -> bool:
        """Remove the service and all its replica rows (events stay, for history)."""
        with self._scope() as s:
            s.exec(delete(ReplicaRow).where(col(ReplicaRow.service) == name))
            result = s.exec(delete(ServiceRow).where(col(ServiceRow.name) == name))
            return result.rowcount > 0

    # ---- replicas -----------------------------------------------------------------

    def add_replica(
        self, service: str, *, cloud: str, region: str, zone: str, market: str | Market, **fields: Any
    ) -> ReplicaRow:
        """A new PENDING replica "<service>-<n>"; n comes from the service's counter, so it
        is unique even across concurrent writers and never reused."""
        _check_fields("replica", fields, _REPLICA_FIELDS - {"state"})
        with self._scope() as s:
            bumped = s.exec(
                update(ServiceRow)
                .where(col(ServiceRow.name) == service)
                .values(next_replica_index=ServiceRow.next_replica_index + 1)
                .returning(ServiceRow.next_replica_index)
            ).first()
            if bumped is None:
                raise RowNotFound(f"no service {service!r}")
            index = bumped[0] - 1
            row = ReplicaRow(
                replica_id=f"{service}-{index}",
                service=service,
                index=index,
                cloud=cloud,
                region=region,
                zone=zone,
                market=Market(market).value,
                **fields,
            )
            s.add(row)
            s.flush()
            return row

    def get_replica(self, replica_id: str) -> ReplicaRow | None:
        with self._read_scope() as s:
            return s.get(ReplicaRow, replica_id)

    def update_replica(
        self, replica_id: str, expected_version: int, *, reason: str = "", **fields: Any
    ) -> ReplicaRow:
        """Set fields if the row is still at expected_version (ConflictError otherwise).

        A new `state` (ReplicaState or its value) must be an edge of VALID_TRANSITIONS
        (IllegalTransition otherwise); it is recorded as a "transition" event with `reason`,
        and `status_message` defaults to the reason.
        """
        _check_fields("replica", fields, _REPLICA_FIELDS)
        with self._scope() as s:
            current = s.get(ReplicaRow, replica_id)
            if current is None:
                raise RowNotFound(f"no replica {replica_id!r}")
            record = None
            if "state" in fields:
                new = ReplicaState(fields["state"])
                fields["state"] = new.value
                if new.value != current.state:
                    record = transition(ReplicaState(current.state), new, reason)
                    fields.setdefault("status_message", reason or record.edge)
            row = _versioned_update(
                s, ReplicaRow, ReplicaRow.replica_id, replica_id, expected_version, fields
            )
            if record is not None:
                data = {"from": record.from_state.value, "to": record.to_state.value, "reason": reason}
                _insert_event(
                    s,
                    "transition",
                    row.service,
                    replica_id,
                    row.location,
                    row.market,
                    record.message(),
                    data,
                    record.at,
                )
            return row

    def list_replicas(self, service: str | None = None, include_terminal: bool = False) -> list[ReplicaRow]:
        """Replicas by (service, index); terminal ones (FAILED*, PREEMPTED, TERMINATED) only
        when asked. SHUTTING_DOWN ones are included: their instance still needs to go."""
        query = select(ReplicaRow)
        if service is not None:
            query = query.where(col(ReplicaRow.service) == service)
        if not include_terminal:
            query = query.where(col(ReplicaRow.state).not_in(_TERMINAL_VALUES))
        with self._read_scope() as s:
            return list(s.exec(query.order_by(ReplicaRow.service, ReplicaRow.index)))

    def fill_spec_revision(self, service: str, revision: str) -> int:
        """Give the service's replicas of unknown launch revision (rows of a daemon from before
        revisions) this one; how many. Not versioned: nobody else writes a NULL revision."""
        with self._scope() as s:
            query = (update(ReplicaRow).where(col(ReplicaRow.service) == service)
                     .where(col(ReplicaRow.spec_revision).is_(None)).values(spec_revision=revision))
            count = s.exec(query).rowcount
            s.expire_all()
            return count

    def delete_replica(self, replica_id: str) -> bool:
        with self._scope() as s:
            return s.exec(delete(ReplicaRow).where(col(ReplicaRow.replica_id) == replica_id)).rowcount > 0

    # ---- bootstrap tokens -------------------------------------------------------------

    def add_bootstrap_token(self, token_hash: str, service: str, replica_id: str, expires_at: float) -> None:
        with self._scope() as s:
            s.add(BootstrapTokenRow(token_hash=token_hash, service=service, replica_id=replica_id,
                                    expires_at=expires_at))

    def get_bootstrap_token(self, token_hash: str) -> BootstrapTokenRow | None:
        with self._read_scope() as s:
            return s.get(BootstrapTokenRow, token_hash)

    def redeem_bootstrap_token(self, token_hash: str) -> bool:
        """Mark the token used; False when it already was (one use, even under a race)."""
        with self._scope() as s:
            result = s.exec(update(BootstrapTokenRow)
                            .where(col(BootstrapTokenRow.token_hash) == token_hash,
                                   col(BootstrapTokenRow.redeemed_at).is_(None))
                            .values(redeemed_at=_now()))
            return result.rowcount > 0

    def delete_bootstrap_tokens(self, service: str) -> None:
        with self._scope() as s:
            s.exec(delete(BootstrapTokenRow).where(col(BootstrapTokenRow.service) == service))

    # ---- events -------------------------------------------------------------------

    def record_event(
        self,
        kind: str,
        *,
        service: str | None = None,
        replica_id: str | None = None,
        location: Location | None = None,
        market: str | Market | None = None,
        message: str = "",
        data: dict[str, Any] | None = None,
        at: float | None = None,
    ) -> EventRow:
        with self._scope() as s:
            return _insert_event(s, kind, service, replica_id, location, market, message, data, at)

    def list_events(
        self,
        service: str | None = None,
        since: float | None = None,
        limit: int | None = None,
        kinds: Iterable[str] | None = None,
        replica_id: str | None = None,
    ) -> list[EventRow]:
        """Events in the order they were recorded (oldest first); with `limit`, the newest
        `limit` of them (still oldest first). `since` is exclusive (at > since)."""
        query = select(EventRow)
        if service is not None:
            query = query.where(col(EventRow.service) == service)
        if replica_id is not None:
            query = query.where(col(EventRow.replica_id) == replica_id)
        if since is not None:
            query = query.where(col(EventRow.at) > since)
        if kinds is not None:
            query = query.where(col(EventRow.kind).in_(list(kinds)))
        if limit is not None:
            query = query.order_by(col(EventRow.id).desc()).limit(limit)
        else:
            query = query.order_by(col(EventRow.id))
        with self._read_scope() as s:
            rows = list(s.exec(query))
        return sorted(rows, key=lambda r: r.id) if limit is not None else rows

    # ---- prices -------------------------------------------------------------------

    def record_offers(self, offers: Iterable[Offer]) -> int:
        """Append price quotes and refresh each location's cheapest spot/on-demand price."""
        offers = list(offers)
        with self._scope() as s:
            for o in offers:
                s.add(
                    PriceQuote(
                        cloud=o.location.cloud,
                        region=o.location.region,
                        zone=o.location.zone,
                        instance_type=o.instance_type,
                        accelerator=o.accelerator,
                        accelerator_count=o.accelerator_count,
                        market=Market(o.market).value,
                        price_per_hour=o.price_per_hour,
                        observed_at=o.observed_at,
                    )
                )
            cheapest: dict[tuple[Location, Market], float] = {}
            for o in offers:
                key = (o.location, Market(o.market))
                cheapest[key] = min(cheapest.get(key, o.price_per_hour), o.price_per_hour)
            for loc in {loc for loc, _ in cheapest}:
                row = s.get(LocationRow, (loc.cloud, loc.region, loc.zone)) or LocationRow(
                    cloud=loc.cloud, region=loc.region, zone=loc.zone
                )
                row.spot_price = cheapest.get((loc, Market.SPOT), row.spot_price)
                row.on_demand_price = cheapest.get((loc, Market.ON_DEMAND), row.on_demand_price)
                row.updated_at = _now()
                s.add(row)
            s.flush()
        return len(offers)

    def latest_offers(self, cloud: str | None = None, max_age_s: float | None = None) -> list[Offer]:
        """The newest quote per (location, instance type, accelerator, market)."""
        key = (
            PriceQuote.cloud, PriceQuote.region, PriceQuote.zone, PriceQuote.instance_type,
            PriceQuote.accelerator, PriceQuote.accelerator_count, PriceQuote.market,
        )  # fmt: skip
        newest = select(*key, func.max(PriceQuote.observed_at).label("at")).group_by(*key)
        if cloud is not None:
            newest = newest.where(col(PriceQuote.cloud) == cloud)
        if max_age_s is not None:
            newest = newest.where(col(PriceQuote.observed_at) >= _now() - max_age_s)
        sub = newest.subquery()
        query = select(PriceQuote).join(
            sub,
            (col(PriceQuote.cloud) == sub.c.cloud)
            & (col(PriceQuote.region) == sub.c.region)
            & (col(PriceQuote.zone) == sub.c.zone)
            & (col(PriceQuote.instance_type) == sub.c.instance_type)
            & (col(PriceQuote.accelerator) == sub.c.accelerator)
            & (col(PriceQuote.accelerator_count) == sub.c.accelerator_count)
            & (col(PriceQuote.market) == sub.c.market)
            & (col(PriceQuote.observed_at) == sub.c.at),
        )
        with self._read_scope() as s:
            rows = list(s.exec(query.order_by(PriceQuote.cloud, PriceQuote.zone, PriceQuote.id)))
        seen: dict[tuple, Offer] = {}  # equal timestamps: keep one quote per key
        for r in rows:
            seen[
                (r.cloud, r.region, r.zone, r.instance_type, r.accelerator, r.accelerator_count, r.market)
            ] = Offer(
                location=Location(r.cloud, r.region, r.zone),
                instance_type=r.instance_type,
                accelerator=r.accelerator,
                accelerator_count=r.accelerator_count,
                market=Market(r.market),
                price_per_hour=r.price_per_hour,
                observed_at=r.observed_at,
            )
        return list(seen.values())

    def list_locations(self, cloud: str | None = None) -> list[LocationRow]:
        query = select(LocationRow)
        if cloud is not None:
            query = query.where(col(LocationRow.cloud) == cloud)
        with self._read_scope() as s:
            return list(s.exec(query.order_by(LocationRow.cloud, LocationRow.region, LocationRow.zone)))

    def prune_price_quotes(self, older_than: float) -> int:
        """Delete quotes observed before `older_than` (unix seconds); returns how many."""
        with self._scope() as s:
            return s.exec(delete(PriceQuote).where(col(PriceQuote.observed_at) < older_than)).rowcount


def _insert_event(
    s: Session,
    kind: str,
    service: str | None,
    replica_id: str | None,
    location: Location | None,
    market: str | Market | None,
    message: str,
    data: dict[str, Any] | None,
    at: float | None,
) -> EventRow:
    row = EventRow(
        at=at if at is not None else _now(),
        service=service,
        replica_id=replica_id,
        kind=kind,
        cloud=location.cloud if location else None,
        region=location.region if location else None,
        zone=location.zone if location else None,
        market=Market(market).value if market is not None else None,
        message=message,
        data_json=json.dumps(data or {}, sort_keys=True, default=str),
    )
    s.add(row)
    s.flush()
    return row


def _check_fields(what: str, fields: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise TypeError(
            f"cannot set {what} field(s) {', '.join(unknown)}; settable: {', '.join(sorted(allowed))}"
        )


def _versioned_update(
    s: Session, table: type[SQLModel], key_col: Any, key: str, expected: int | None, fields: dict
):
    """UPDATE ... SET fields, version = version + 1 WHERE key AND version = expected: the
    compare-and-set is one statement, so it is atomic on every database."""
    values = {**fields, "updated_at": _now(), "version": table.version + 1}
    query = update(table).where(key_col == key)
    if expected is not None:
        query = query.where(table.version == expected)
    if s.exec(query.values(**values)).rowcount == 0:
        row = s.get(table, key)
        if row is None:
            raise RowNotFound(f"no {table.__tablename__[:-1]} {key!r}")
        raise ConflictError(
            f"{table.__tablename__[:-1]} {key!r} is at version {row.version}, not {expected}: re-read and retry"
        )
    s.expire_all()  # the UPDATE bypassed the identity map
    return s.get(table, key)


# ---- the engine ---------------------------------------------------------------------

# Set while a Store.reading() transaction begins: its BEGIN takes no write lock.
_READ_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("store_read_only", default=False)


def default_url() -> str:
    return os.environ.get(DB_URL_ENV) or f"sqlite:///{paths.home() / 'state.db'}"


def make_engine(url: str) -> Engine:
    """The engine for a database URL (SQLite: WAL, busy timeout, foreign keys, BEGIN IMMEDIATE).
    Store() and orchestrator.control.migrations' env.py use it."""
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    memory = url in ("sqlite://", "sqlite:///:memory:")
    if not memory:
        Path(make_url(url).database or "").expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        connect_args={"timeout": 30, "check_same_thread": False},
        # An in-memory database exists once per connection: share one (tests, throwaway use).
        poolclass=StaticPool if memory else None,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        # Let SQLAlchemy, not pysqlite, emit BEGIN (pysqlite's own handling is not
        # transactional for DDL and delays BEGIN); WAL lets readers run beside one writer.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if not memory:
            cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")  # with WAL: atomic always, durable but for power loss
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        # IMMEDIATE takes the write lock up front: two writers queue (busy_timeout) instead of
        # both reading and then one failing to upgrade its lock with "database is locked".
        # A read transaction (Store.reading) begins DEFERRED: WAL readers need no lock (the
        # in-memory database shares one connection between threads: kept IMMEDIATE there).
        conn.exec_driver_sql("BEGIN" if _READ_ONLY.get() and not memory else "BEGIN IMMEDIATE")

    return engine


class Tx(_Ops):
    """One open transaction: every Store operation, all committed together or not at all."""

    def __init__(self, session: Session):
        self.session = session

    @contextlib.contextmanager
    def _scope(self) -> Iterator[Session]:
        yield self.session


class Store(_Ops):
    """The state store. Safe to share between threads (a session per call)."""

    def __init__(self, url: str | None = None):
        """Open the database and upgrade its schema to this code's (migrations.upgrade)."""
        self.url = url or default_url()
        self.engine = make_engine(self.url)
        self._local = threading.local()
        # Bumped after every committed transaction that wrote (its thread's flag, set by any
        # INSERT, UPDATE or DELETE): a fleet snapshot (orchestrator.control.snapshot) stays
        # current while it is unchanged. The daemon is its database's only writer (one leader).
        self._writes = itertools.count(1)
        self.generation = 0
        event.listen(self.engine, "after_cursor_execute", self._on_execute)
        try:
            migrations.upgrade(self.engine)  # SchemaTooNew for a database of a newer version
        except BaseException:
            self.engine.dispose()
            raise

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tx]:
        """All operations on the yielded Tx commit together at the end of the block; an
        exception (or a crash of the process) anywhere inside leaves nothing written."""
        if getattr(self._local, "open", False):
            # On SQLite a second transaction would wait for the first one's lock: forever.
            raise StateError("a Store method was called inside store.transaction(): call it on the tx")
        self._local.open = True
        self._local.wrote = False
        try:
            # expire_on_commit=False: rows handed out stay readable after the session closes.
            with Session(self.engine, expire_on_commit=False) as session, session.begin():
                yield Tx(session)
        finally:
            self._local.open = False
            if self._local.wrote:  # after the commit (or rollback): a snapshot read now sees it
                self.generation = next(self._writes)

    @contextlib.contextmanager
    def reading(self) -> Iterator[Tx]:
        """A transaction that only reads. On SQLite it begins DEFERRED, not IMMEDIATE: in WAL
        mode readers take no write lock, so a thousand services' reads neither queue behind each
        other nor behind the writer (each sees the last commit). Writing inside one is a bug."""
        token = _READ_ONLY.set(True)
        try:
            with self.transaction() as tx:
                yield tx
        finally:
            _READ_ONLY.reset(token)

    def _on_execute(self, _conn, _cursor, _statement, _params, context, _executemany) -> None:
        if not (context.isinsert or context.isupdate or context.isdelete):
            return
        # Events, quotes and tokens are not in a snapshot: writing them leaves it current.
        table = getattr(getattr(getattr(context, "compiled", None), "statement", None), "table", None)
        if getattr(table, "name", None) not in _UNSNAPSHOTTED_TABLES:
            self._local.wrote = True

    @contextlib.contextmanager
    def _scope(self) -> Iterator[Session]:
        with self.transaction() as tx:
            yield tx.session

    @contextlib.contextmanager
    def _read_scope(self) -> Iterator[Session]:
        with self.reading() as tx:
            yield tx.session

    def close(self) -> None:
        self.engine.dispose()
