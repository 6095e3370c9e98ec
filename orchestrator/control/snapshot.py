"""The whole fleet's rows read once per pass: what keeps a reconcile or probe pass over a
thousand services from asking the database a dozen times per service.

The daemon's reconcile and probe jobs take a `FleetSnapshot` (two queries: every service, every
replica) and hand each controller `snapshot.reads(service)`: a stand-in for the store whose
get_service, get_replica and list_replicas answer from the snapshot while the store has not
committed a write since it was taken (`Store.generation`), and from the store itself after;
every other call goes to the store. A quiet fleet's pass reads nothing more; a busy one reads
as before from its first write on, so no decision is made on rows older than the last write.
"""

from __future__ import annotations

from collections import defaultdict

from orchestrator.control.store import ReplicaRow, ServiceRow, Store
from orchestrator.fleet.lifecycle import TERMINAL_STATES

_TERMINAL = frozenset(s.value for s in TERMINAL_STATES)


class FleetSnapshot:
    def __init__(self, store: Store):
        self.store = store
        self.generation = store.generation  # before the reads: a write after it makes them stale
        with store.reading() as tx:  # no write lock: a pass's reads do not queue behind writers
            self._services = {row.name: row for row in tx.list_services()}
            replicas = tx.list_replicas(include_terminal=True)  # by (service, index)
        self._replicas: dict[str, list[ReplicaRow]] = defaultdict(list)
        self._by_id: dict[str, ReplicaRow] = {}
        for row in replicas:
            self._replicas[row.service].append(row)
            self._by_id[row.replica_id] = row

    def fresh(self) -> bool:
        return self.store.generation == self.generation

    def reads(self, service: str) -> ServiceReads:
        return ServiceReads(self, service)


class ServiceReads:
    """One service's view of a FleetSnapshot, shaped like the Store its controller uses."""

    def __init__(self, snapshot: FleetSnapshot, service: str):
        self._snapshot, self._service = snapshot, service

    def get_service(self, name: str) -> ServiceRow | None:
        if name != self._service or not self._snapshot.fresh():
            return self._snapshot.store.get_service(name)
        return self._snapshot._services.get(name)

    def get_replica(self, replica_id: str) -> ReplicaRow | None:
        row = self._snapshot._by_id.get(replica_id)
        if row is None or row.service != self._service or not self._snapshot.fresh():
            return self._snapshot.store.get_replica(replica_id)
        return row

    def list_replicas(self, service: str | None = None, include_terminal: bool = False) -> list[ReplicaRow]:
        if service != self._service or not self._snapshot.fresh():
            return self._snapshot.store.list_replicas(service, include_terminal)
        rows = self._snapshot._replicas.get(service, [])
        return list(rows) if include_terminal else [r for r in rows if r.state not in _TERMINAL]

    def __getattr__(self, name: str):
        return getattr(self._snapshot.store, name)
