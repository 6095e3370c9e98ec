"""The state store on a real SQLite file: transactions, optimistic concurrency, crash safety."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from orchestrator.fleet.lifecycle import IllegalTransition, ReplicaState
from orchestrator.control.store import ConflictError, RowNotFound, ServiceStatus, StateError, Store, default_url
from providers.base import Location, Market, Offer
from tests.fakes.postgres import fresh_db

REPO = Path(__file__).resolve().parents[2]
A = Location("local", "local", "local-a")
B = Location("local", "local", "local-b")


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    """The same tests on a SQLite file and on a real PostgreSQL server."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'state.db'}"
    else:
        url = fresh_db(request.getfixturevalue("postgres_server"))
    s = Store(url)
    yield s
    s.close()


def add(tx_or_store, service="chat", loc=A, market=Market.SPOT, **fields):
    return tx_or_store.add_replica(service, cloud=loc.cloud, region=loc.region, zone=loc.zone, market=market, **fields)


def walk(store, replica_id, *states):
    row = store.get_replica(replica_id)
    for state in states:
        row = store.update_replica(replica_id, row.version, state=state, reason=f"to {state}")
    return row


def test_default_url_uses_home_and_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOT_ORCHESTRATOR_HOME", str(tmp_path / "h"))
    monkeypatch.delenv("SPOT_ORCHESTRATOR_DB_URL", raising=False)
    assert default_url() == f"sqlite:///{tmp_path / 'h' / 'state.db'}"
    store = Store()
    store.create_or_update_service("chat", "{}")
    store.close()
    with sqlite3.connect(tmp_path / "h" / "state.db") as db:  # a real file, in WAL mode
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT name FROM services").fetchall() == [("chat",)]
    monkeypatch.setenv("SPOT_ORCHESTRATOR_DB_URL", f"sqlite:///{tmp_path / 'other.db'}")
    assert Store().url == f"sqlite:///{tmp_path / 'other.db'}"


def test_service_crud(store):
    row = store.create_or_update_service("chat", '{"a": 1}')
    assert (row.name, row.status, row.version) == ("chat", ServiceStatus.PENDING, 1)
    row = store.create_or_update_service("chat", '{"a": 2}', endpoint="http://127.0.0.1:9", lb_port=9)
    assert (row.spec_json, row.version, row.endpoint, row.lb_port) == ('{"a": 2}', 2, "http://127.0.0.1:9", 9)
    row = store.update_service("chat", row.version, status=ServiceStatus.READY)
    assert row.status == "READY" and row.version == 3
    with pytest.raises(ConflictError, match="version 3, not 1"):
        store.update_service("chat", 1, status=ServiceStatus.FAILED)
    with pytest.raises(RowNotFound):
        store.update_service("nope", status="READY")
    with pytest.raises(TypeError, match="cannot set service field"):
        store.update_service("chat", colour="red")
    store.create_or_update_service("api", "{}")
    assert [s.name for s in store.list_services()] == ["api", "chat"]
    assert store.get_service("chat").status == "READY"
    assert store.get_service("missing") is None


def test_replica_ids_are_sequential_and_never_reused(store):
    store.create_or_update_service("chat", "{}")
    r1, r2 = add(store), add(store, loc=B, market=Market.ON_DEMAND)
    assert (r1.replica_id, r1.index, r2.replica_id) == ("chat-1", 1, "chat-2")
    assert (r2.zone, r2.market, r2.state, r2.version) == ("local-b", "on_demand", "PENDING", 1)
    assert r2.location == B and r2.market_enum is Market.ON_DEMAND and r2.replica_state is ReplicaState.PENDING
    assert store.delete_replica("chat-2")
    assert add(store).replica_id == "chat-3"
    with pytest.raises(RowNotFound, match="no service 'ghost'"):
        add(store, service="ghost")


def test_update_replica_versions_and_transitions(store):
    store.create_or_update_service("chat", "{}")
    r = add(store)
    r = store.update_replica(r.replica_id, 1, state=ReplicaState.PROVISIONING, reason="launching in local-a")
    assert (r.state, r.version, r.status_message) == ("PROVISIONING", 2, "launching in local-a")
    with pytest.raises(ConflictError, match="at version 2, not 1"):
        store.update_replica(r.replica_id, 1, state="STARTING")
    with pytest.raises(IllegalTransition, match="PROVISIONING -> READY"):
        store.update_replica(r.replica_id, 2, state="READY")
    assert store.get_replica(r.replica_id).version == 2  # a refused update wrote nothing
    r = store.update_replica(r.replica_id, 2, instance_id="local-1", endpoint="http://127.0.0.1:1", price_per_hour=0.3)
    assert (r.instance_id, r.version, r.state) == ("local-1", 3, "PROVISIONING")
    with pytest.raises(TypeError, match="cannot set replica field"):
        store.update_replica(r.replica_id, 3, version=9)
    with pytest.raises(RowNotFound):
        store.update_replica("chat-99", 1, state="READY")
    events = store.list_events(service="chat", kinds=["transition"])
    assert [(e.replica_id, json.loads(e.data_json)["to"]) for e in events] == [("chat-1", "PROVISIONING")]
    assert events[0].message == "PENDING -> PROVISIONING: launching in local-a"
    assert (events[0].zone, events[0].market) == ("local-a", "spot")


def test_concurrent_writers_one_wins(store, tmp_path):
    """Two controllers read the same version; exactly one update lands."""
    store.create_or_update_service("chat", "{}")
    r = add(store)
    other = Store(store.url)
    results = []

    def attempt(s, zone):
        try:
            s.update_replica(r.replica_id, r.version, zone=zone)
            results.append("ok")
        except ConflictError:
            results.append("conflict")

    threads = [threading.Thread(target=attempt, args=(s, z)) for s, z in ((store, "x"), (other, "y"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["conflict", "ok"]
    other.close()


def test_concurrent_add_replica_allocates_unique_indexes(store):
    store.create_or_update_service("chat", "{}")
    stores = [Store(store.url) for _ in range(4)]
    ids: list[str] = []
    lock = threading.Lock()

    def work(s):
        for _ in range(10):
            rid = add(s).replica_id
            with lock:
                ids.append(rid)

    threads = [threading.Thread(target=work, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ids, key=lambda i: int(i.split("-")[1])) == [f"chat-{n}" for n in range(1, 41)]
    for s in stores:
        s.close()


def test_list_replicas_hides_terminal_ones(store):
    store.create_or_update_service("chat", "{}")
    store.create_or_update_service("other", "{}")
    a, b, c = add(store), add(store), add(store, service="other")
    walk(store, a.replica_id, "PROVISIONING", "FAILED_PROVISION")
    walk(store, b.replica_id, "PROVISIONING", "STARTING", "READY", "SHUTTING_DOWN")
    assert [r.replica_id for r in store.list_replicas("chat")] == ["chat-2"]  # SHUTTING_DOWN still listed
    assert [r.replica_id for r in store.list_replicas("chat", include_terminal=True)] == ["chat-1", "chat-2"]
    assert [r.replica_id for r in store.list_replicas()] == ["chat-2", c.replica_id]


def test_delete_service_removes_replicas_keeps_events(store):
    store.create_or_update_service("chat", "{}")
    r = add(store)
    walk(store, r.replica_id, "PROVISIONING")
    assert store.delete_service("chat")
    assert store.get_service("chat") is None and store.list_replicas(include_terminal=True) == []
    assert len(store.list_events(service="chat")) == 1
    assert not store.delete_service("chat")


def test_transaction_rolls_back_everything_on_error(store):
    with pytest.raises(RuntimeError, match="boom"):
        with store.transaction() as tx:
            tx.create_or_update_service("chat", "{}")
            add(tx)
            add(tx, loc=B)
            tx.record_event("launch", service="chat", message="two replicas")
            assert len(tx.list_replicas("chat")) == 2  # visible inside the transaction
            raise RuntimeError("boom")
    assert store.get_service("chat") is None
    assert store.list_replicas(include_terminal=True) == []
    assert store.list_events() == []
    # and the store is still usable, with the same ids as if nothing had happened
    with store.transaction() as tx:
        tx.create_or_update_service("chat", "{}")
        assert add(tx).replica_id == "chat-1"


def test_rows_are_detached_plain_values(store):
    with store.transaction() as tx:
        tx.create_or_update_service("chat", "{}")
        r = add(tx)
    assert r.replica_id == "chat-1" and r.state == "PENDING"  # readable after commit
    r.zone = "elsewhere"  # does not write back
    assert store.get_replica("chat-1").zone == "local-a"


def test_nested_store_call_in_transaction_is_refused(store):
    with pytest.raises(StateError, match="call it on the tx"):
        with store.transaction():
            store.list_services()


CRASHER = textwrap.dedent(
    """
    import sys, time
    from orchestrator.control.store import Store
    store = Store(sys.argv[1])
    with store.transaction() as tx:
        tx.create_or_update_service("doomed", "{}")
        for zone in ("local-a", "local-b", "local-c"):
            tx.add_replica("doomed", cloud="local", region="local", zone=zone, market="spot")
        tx.record_event("launch", service="doomed")
        tx.session.flush()  # the rows are in the database file's journal, not committed
        print("inside", flush=True)
        time.sleep(120)
    """
)


def test_sigkill_mid_transaction_leaves_db_consistent(store, tmp_path):
    store.create_or_update_service("kept", "{}")
    add(store, service="kept")
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHER, store.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "inside", proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if store.url.startswith("sqlite"):
        with sqlite3.connect(store.url.removeprefix("sqlite:///")) as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    fresh = Store(store.url)  # as a restarted daemon would
    assert [s.name for s in fresh.list_services()] == ["kept"]
    assert [r.replica_id for r in fresh.list_replicas(include_terminal=True)] == ["kept-1"]
    assert fresh.list_events(service="doomed") == []
    fresh.create_or_update_service("doomed", "{}")  # the killed writer's lock is gone
    assert add(fresh, service="doomed").replica_id == "doomed-1"
    fresh.close()


def test_events_filters_and_limit(store):
    for i in range(5):
        store.record_event("notice" if i % 2 else "launch", service="chat", message=str(i), at=1000.0 + i)
    store.record_event("capacity_error", location=A, market=Market.SPOT, data={"n": 1}, at=2000.0)
    assert [e.message for e in store.list_events(service="chat")] == ["0", "1", "2", "3", "4"]
    assert [e.message for e in store.list_events(service="chat", limit=2)] == ["3", "4"]  # newest, oldest first
    assert [e.message for e in store.list_events(since=1002.0, service="chat")] == ["3", "4"]
    assert [e.message for e in store.list_events(kinds=["notice"])] == ["1", "3"]
    market_wide = store.list_events(kinds=["capacity_error"])[0]
    assert (market_wide.service, market_wide.zone, market_wide.market) == (None, "local-a", "spot")
    assert json.loads(market_wide.data_json) == {"n": 1}


def test_price_book(store):
    def offer(loc, market, price, at, itype="local-cpu"):
        return Offer(loc, itype, "CPU", 1, market, price, observed_at=at)

    now = time.time()
    assert (
        store.record_offers([offer(A, Market.SPOT, 0.30, now - 100), offer(A, Market.ON_DEMAND, 1.0, now - 100)]) == 2
    )
    store.record_offers([offer(A, Market.SPOT, 0.25, now), offer(B, Market.SPOT, 0.40, now)])
    latest = {(o.location.zone, o.market): o.price_per_hour for o in store.latest_offers()}
    assert latest == {
        ("local-a", Market.SPOT): 0.25,
        ("local-a", Market.ON_DEMAND): 1.0,
        ("local-b", Market.SPOT): 0.40,
    }
    assert {o.market for o in store.latest_offers(max_age_s=50)} == {Market.SPOT}
    assert store.latest_offers(cloud="aws") == []
    locs = {(r.zone, r.spot_price, r.on_demand_price) for r in store.list_locations()}
    assert locs == {("local-a", 0.25, 1.0), ("local-b", 0.40, None)}
    assert store.list_locations()[0].location == A
    assert store.prune_price_quotes(older_than=now - 50) == 2
    assert len(store.latest_offers()) == 2


def test_in_memory_and_missing_parent_directory(tmp_path):
    memory = Store("sqlite://")  # one shared connection: the data survives between calls
    memory.create_or_update_service("chat", "{}")
    assert [s.name for s in memory.list_services()] == ["chat"]
    nested = Store(f"sqlite:///{tmp_path / 'a' / 'b' / 'state.db'}")
    nested.create_or_update_service("chat", "{}")
    assert (tmp_path / "a" / "b" / "state.db").exists()


def test_reads_do_not_queue_behind_a_writer(store):
    """A read (and a fleet snapshot's) answers while another thread's write transaction is
    open, seeing the last commit: on SQLite reads begin DEFERRED (WAL), writes IMMEDIATE."""
    from orchestrator.control.snapshot import FleetSnapshot

    store.create_or_update_service("chat", "{}")
    writing, release = threading.Event(), threading.Event()

    def writer() -> None:
        with store.transaction() as tx:
            tx.update_service("chat", status=ServiceStatus.READY)
            writing.set()
            release.wait(30)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert writing.wait(10)
        seen: list = []
        reader = threading.Thread(target=lambda: seen.extend(
            [store.get_service("chat").status, len(store.list_replicas()), FleetSnapshot(store).reads("chat")
             .get_service("chat").status]))
        reader.start()
        reader.join(10)
        finished = not reader.is_alive()
    finally:
        release.set()
        thread.join()
    assert finished, "a read waited for the writer's transaction"
    assert seen == [ServiceStatus.PENDING, 0, ServiceStatus.PENDING]  # the last commit, not the open write
    assert store.get_service("chat").status == ServiceStatus.READY
