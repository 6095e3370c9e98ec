"""The fleet snapshot a daemon pass reads: served without a query while the store has committed
no write since it was taken, and from the store from the first write on (its own or anyone's)."""

from __future__ import annotations

from sqlalchemy import event

from orchestrator.control.snapshot import FleetSnapshot
from orchestrator.control.store import Store
from orchestrator.fleet.lifecycle import ReplicaState as S


def fleet(tmp_path) -> Store:
    store = Store(f"sqlite:///{tmp_path / 'state.db'}")
    for name in ("a", "b"):
        store.create_or_update_service(name, "{}")
        for _ in range(2):
            store.add_replica(name, cloud="local", region="local", zone="local-a", market="spot")
    done = store.list_replicas("a")[0]
    store.update_replica(done.replica_id, done.version, state=S.TERMINATED.value)
    return store


def queries(store: Store) -> list[str]:
    seen: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda _c, _cur, sql, *_: seen.append(sql))
    return seen


def test_a_fresh_snapshot_answers_one_services_reads_without_a_query(tmp_path):
    store = fleet(tmp_path)
    snapshot = FleetSnapshot(store)
    seen = queries(store)
    reads = snapshot.reads("a")
    assert [r.replica_id for r in reads.list_replicas("a")] == [r.replica_id for r in store.list_replicas("a")]
    seen.clear()
    assert len(reads.list_replicas("a", include_terminal=True)) == 2
    assert len(reads.list_replicas("a")) == 1  # the terminated one only when asked
    assert reads.get_service("a").name == "a"
    assert reads.get_replica(reads.list_replicas("a")[0].replica_id) is not None
    assert seen == []


def test_after_any_write_the_reads_are_the_stores(tmp_path):
    store = fleet(tmp_path)
    snapshot = FleetSnapshot(store)
    reads = snapshot.reads("b")
    row = reads.list_replicas("b")[0]
    store.update_replica(row.replica_id, row.version, state=S.PROVISIONING.value)  # another thread's write
    assert not snapshot.fresh()
    assert reads.get_replica(row.replica_id).state == S.PROVISIONING.value
    assert {r.state for r in reads.list_replicas("b")} == {S.PENDING.value, S.PROVISIONING.value}


def test_another_services_reads_and_every_other_call_go_to_the_store(tmp_path):
    store = fleet(tmp_path)
    reads = FleetSnapshot(store).reads("a")
    seen = queries(store)
    assert len(reads.list_replicas("b")) == 2 and seen  # not its service: asked of the store
    added = reads.add_replica("a", cloud="local", region="local", zone="local-b", market="spot")
    assert added.replica_id in {r.replica_id for r in reads.list_replicas("a")}  # its own write, seen at once


def test_only_writes_to_what_a_snapshot_holds_move_the_generation(tmp_path):
    store = fleet(tmp_path)
    before = store.generation
    store.list_replicas()
    store.get_service("a")
    store.record_event("note", service="a", message="x")  # events are not in a snapshot
    assert store.generation == before
    store.update_service("a", status="READY")
    assert store.generation != before
