"""notice -> drain -> cut -> flush KV -> resume in-flight requests elsewhere (the preemption path).

The daemon makes one Migrator and hands it every notice (agents' POST /v1/notices, the clouds'
feeds read by the reconcile loop, `spotctl chaos`). In this order: the service's load balancer
drains the replica at once (before the controller's lock, which a reconcile pass may hold), the
controller marks it DRAINING and a replacement is asked for now; the LB cuts its streams, the
replica's connector flushes its unstored KV blocks, and only then are the cut streams continued
on healthy replicas, which load the prefix from the shard stores. A notice whose deadline has
passed is an immediate loss (no flush). What the continuations loaded and recomputed goes to the
daemon's /metrics (spot_migration_*, by service) and the events. docs/preemption.md has each step's reason.
An update's replaced replicas take the same path (`retire`): a notice of the daemon's own, with
a deadline, after which the replica's controller terminates it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from orchestrator.fleet import decisions
from orchestrator.lb.continuation import seam_id_in
from orchestrator.common.errors import UserError
from orchestrator.fleet.lifecycle import ReplicaState, is_alive
from orchestrator.control.store import ReplicaRow, Store
from providers.base import Notice, NoticeKind, Provider

if TYPE_CHECKING:  # type hints only: the daemon wires the live objects in
    from orchestrator.control.balancers import ServiceBalancer
    from orchestrator.control.controller import Controller

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 10.0  # a flush longer than this costs the clients more than a recompute
RESUME_TIMEOUT_S = 300.0  # CPU replicas under load can take minutes to admit a long prefix
STATS_TIMEOUT_S = 5.0
OUTCOME_WAIT_S = 30.0
# An update's retired replica: the deadline its migration is given (the flush gets at most
# FLUSH_TIMEOUT_S of it); past it plus the drain overrun, the controller ends the replica anyway.
RETIRE_GRACE_S = 30.0
MIGRATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class MigrationMetrics:
    """The preemption path's counters, labelled by service, in the daemon's registry (its
    /metrics): the migrator runs in the daemon, whichever process hosts the load balancers."""

    def __init__(self, registry):
        self.notices = Counter("spot_migration_notices", "Notices acted on", ["service", "outcome"],
                               registry=registry)
        self.flushes = Counter("spot_migration_flushes", "KV flushes of noticed replicas", ["service", "result"],
                               registry=registry)
        self.requests = Counter("spot_migration_requests", "In-flight requests of noticed replicas",
                                ["service", "result"], registry=registry)
        self.loaded_tokens = Counter("spot_migration_kv_loaded_tokens",
                                     "Prompt tokens the continuations loaded from the shard stores", ["service"],
                                     registry=registry)
        self.recomputed_tokens = Counter("spot_migration_kv_recomputed_tokens",
                                         "Prompt tokens the continuations had to recompute", ["service"],
                                         registry=registry)
        self.seconds = Histogram("spot_migration_seconds", "From the notice to every cut request resumed",
                                 ["service"], buckets=MIGRATION_BUCKETS, registry=registry)


@dataclass(frozen=True)
class KVOutcome:
    """What the connectors admitted for a migration's continuations."""

    requests: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0
    max_recomputed: int = 0


def flush_kv(http: httpx.Client, control_endpoint: str, auth: dict[str, str], timeout_s: float) -> bool:
    """POST the connector's /v1/flush: True once every full block it had is stored."""
    try:
        r = http.post(f"{control_endpoint}/v1/flush", params={"timeout_s": f"{timeout_s:.1f}"}, headers=auth,
                      timeout=timeout_s + 5)
        return r.status_code == 200
    except httpx.HTTPError as err:
        log.warning("flush of %s failed: %s (continuations will recompute)", control_endpoint, err)
        return False


def connector_stats(http: httpx.Client, control_endpoint: str, auth: dict[str, str]) -> dict | None:
    """The connector's GET /v1/stats (counters and recent admissions), None when unreachable."""
    try:
        r = http.get(f"{control_endpoint}/v1/stats", headers=auth, timeout=STATS_TIMEOUT_S)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _drains(state: ReplicaState) -> bool:
    """Whether a notice for a replica in this state moves its streams: one that serves or may
    (a repeat for one already DRAINING is deduplicated by the caller), not one already gone."""
    return state is ReplicaState.DRAINING or decisions.notice_arrived(state).state is ReplicaState.DRAINING


class Migrator:
    """Acts on notices for every service of a daemon. It is handed what it uses: the store,
    the daemon's (live) controllers and load balancers by service, a provider per cloud, and
    a way to ask for a reconcile of one service now."""

    def __init__(
        self,
        store: Store,
        controllers: Mapping[str, Controller],
        lbs: Mapping[str, ServiceBalancer],
        provider: Callable[[str], Provider],
        reconcile: Callable[[str], None],
        registry: CollectorRegistry | None = None,
    ):
        self.store = store
        self.controllers = controllers
        self.lbs = lbs
        self.provider = provider
        self.reconcile = reconcile
        self._http = httpx.Client(timeout=FLUSH_TIMEOUT_S + 5)
        # The daemon's registry (its /metrics); a migrator on its own counts into one nobody reads.
        self.metrics = MigrationMetrics(registry if registry is not None else CollectorRegistry())
        self._metrics_lock = threading.Lock()
        self.last_outcome: dict[str, KVOutcome] = {}  # replica id -> what its continuations got
        self._noticed: set[str] = set()  # replicas whose migration has begun (once per replica)
        self._notices_lock = threading.Lock()  # one batch of notices acted on at a time

    def _first_notice(self, replica_id: str) -> bool:
        """True once per replica: the same notice can arrive twice at once (the API's chaos
        call and the reconcile loop reading the cloud's feed), and one migration is enough."""
        with self._metrics_lock:
            if replica_id in self._noticed:
                return False
            self._noticed.add(replica_id)
            return True

    def _replica_for_instance(self, instance_id: str) -> ReplicaRow | None:
        for name in list(self.controllers):
            for r in self.store.list_replicas(name):
                if r.instance_id == instance_id:
                    return r
        return None

    # ---- the notice ----------------------------------------------------------------------

    def on_notice(self, notice: Notice) -> str | None:
        """Handle one notice (from an agent, a cloud feed or chaos); the replica id or None.
        Returns at once: the replacement and the migration run in the background."""
        return self.on_notices([notice])[0]

    def on_notices(self, notices: list[Notice]) -> list[str | None]:
        """Several notices at once (a correlated loss): every replica is drained on the load
        balancer before any stream is cut, so no continuation lands on a replica about to be
        cut itself.

        The load balancer acts first, the controller second: the controller's lock can be
        held for seconds by a reconcile pass that is launching through a cloud API, and the
        streams of a warned replica must not run on (and finish unmigrated) meanwhile."""
        with self._notices_lock:
            found, services = self._move_streams(notices)
        return self._record_notices(found, services)

    def retire(self, replicas: list[ReplicaRow], grace_s: float = RETIRE_GRACE_S) -> None:
        """An update's replacement of serving replicas (their controller calls it): each is
        drained and its streams moved exactly as on a notice due in `grace_s`, marked DRAINING
        by its controller without a market notice, and terminated by it once its streams moved."""
        deadline = time.time() + grace_s
        notices = [Notice(r.instance_id, NoticeKind.MAINTENANCE, deadline, source="update")
                   for r in replicas if r.instance_id]
        with self._notices_lock:
            found, _services = self._move_streams(notices, after=self._retired)
        for _notice, row in found:
            controller = self.controllers.get(row.service) if row is not None else None
            if controller is not None:
                controller.mark_retiring(row, deadline)

    def _retired(self, replica: ReplicaRow) -> None:
        controller = self.controllers.get(replica.service)  # the live one: an `up` may have replaced it
        if controller is not None:
            controller.finish_retire(replica)

    def _move_streams(self, notices: list[Notice], after: Callable[[ReplicaRow], None] | None = None,
                      ) -> tuple[list[tuple[Notice, ReplicaRow | None]], list[str]]:
        """Drain the noticed replicas on their LBs and start their migrations (nothing here
        waits for a controller), `after(replica)` once each one's ended. Under `_notices_lock`,
        so a batch that chaos injects is not split by the reconcile loop reading the same
        notices from the cloud's feed."""
        received = time.monotonic()
        found = [(notice, self._replica_for_instance(notice.instance_id)) for notice in notices]
        moving = [(r, n) for n, r in found if r is not None and _drains(r.replica_state)
                  and self._first_notice(r.replica_id)]
        services = sorted({r.service for r, _n in moving})
        for service in services:
            batch = [(r, n) for r, n in moving if r.service == service]
            lb = self.lbs.get(service)
            if lb is not None:
                lb.drain([r.replica_id for r, _n in batch])
            for r, n in batch:
                log.info("notice for %s (deadline in %.1fs): draining", r.replica_id, n.deadline - time.time())
            threading.Thread(target=self._migrate_then, args=(service, batch, received, after), daemon=True,
                             name=f"migrate-{service}").start()
        return found, services

    def _record_notices(self, found: list[tuple[Notice, ReplicaRow | None]], services: list[str]) -> list[str | None]:
        """The controllers' part: DRAINING in the store, the notice event, the policy told, and
        the replacements asked for now. Outside `_notices_lock`: a reconcile pass holding its
        controller's lock may be waiting for that one."""
        out = []
        for notice, row in found:  # DRAINING in the store, the notice event, the policy told
            controller = self.controllers.get(row.service) if row is not None else None
            replica = controller.handle_notice(notice) if controller is not None else None
            out.append(replica.replica_id if replica else None)
        for service in services:  # the replacements, without waiting a tick
            threading.Thread(target=self.reconcile, args=(service,), daemon=True).start()
        return out

    def _migrate_then(self, service: str, batch: list[tuple[ReplicaRow, Notice]], received: float,
                      after: Callable[[ReplicaRow], None] | None) -> None:
        try:
            self._migrate(service, batch, received)
        finally:
            for replica, _notice in batch if after is not None else ():
                try:
                    after(replica)
                except Exception:  # the controller's deadline enforcement ends it anyway
                    log.exception("after migrating %s", replica.replica_id)

    def _migrate(self, service: str, batch: list[tuple[ReplicaRow, Notice]], received: float) -> None:
        """Move the streams of the noticed replicas of one service (one at a time would let
        one's continuations land on the next)."""
        lb = self.lbs.get(service)
        if lb is None:
            return
        metrics = self.metrics
        victims = {r.replica_id for r, _n in batch}
        started = [(replica, *self._start(lb, replica, notice)) for replica, notice in batch]
        results = []
        for replica, future, lost, end_now in started:
            try:
                results.append((replica, lost, future.result(timeout=RESUME_TIMEOUT_S + 60)))
            except Exception:
                log.exception("migrating the requests of %s failed", replica.replica_id)
            finally:
                if end_now is not None:
                    end_now()  # also when nothing was in flight (the LB then runs no hook)
        if not results:
            return
        took = time.monotonic() - received
        metrics.seconds.labels(service).observe(took)
        for _r, _l, result in results:
            metrics.requests.labels(service, "resumed").inc(result.resumed)
            metrics.requests.labels(service, "failed").inc(result.failed)
        continuations = {sid for _r, _l, result in results for sid in result.continuation_ids}
        peers = [r for r in self._peers(service) if r.replica_id not in victims]  # where they may have landed
        outcome = self._kv_outcome(peers, continuations) if continuations and peers else KVOutcome()
        metrics.loaded_tokens.labels(service).inc(outcome.loaded_tokens)
        metrics.recomputed_tokens.labels(service).inc(outcome.recomputed_tokens)
        for replica, lost, result in results:
            self.last_outcome[replica.replica_id] = outcome
            together = f" (KV for all {len(results)} replicas noticed together)" if len(results) > 1 else ""
            self.store.record_event(
                "migration", service=service, replica_id=replica.replica_id, location=replica.location,
                market=replica.market_enum,
                message=(f"{result.resumed}/{result.requests} streams continued elsewhere in {took:.1f}s; "
                         f"KV loaded {outcome.loaded_tokens} tokens, recomputed {outcome.recomputed_tokens}"
                         + together + (" (deadline already passed)" if lost else "")),
                data={"requests": result.requests, "resumed": result.resumed, "failed": result.failed,
                      "loaded_tokens": outcome.loaded_tokens, "recomputed_tokens": outcome.recomputed_tokens,
                      "max_recomputed_tokens": outcome.max_recomputed, "continuations": outcome.requests,
                      "seconds": round(took, 3), "lost": lost, "batch": sorted(victims)},
            )

    def _start(self, lb, replica: ReplicaRow, notice: Notice):
        """lb.migrate() for one replica (in this process or the data plane's: one interface,
        orchestrator.control.balancers): (its future, lost, the hook that ends it now or None)."""
        lost = notice.deadline <= time.time()
        metrics, service = self.metrics, replica.service
        metrics.notices.labels(service, "lost" if lost else "drained").inc()
        ended = threading.Event()

        def flush() -> None:
            ok = self.flush(replica, timeout_s=max(0.5, min(FLUSH_TIMEOUT_S, notice.deadline - time.time())))
            metrics.flushes.labels(service, "ok" if ok else "failed").inc()

        def end_now() -> None:
            """A passed deadline: nothing to flush from and nothing more to serve. Ended
            after the cut, so that every stream moves as a cut, not as a broken stream."""
            if not ended.is_set():
                ended.set()
                metrics.flushes.labels(service, "skipped").inc()
                threading.Thread(target=self._terminate, args=(replica,), daemon=True).start()

        future = lb.migrate(replica.replica_id, resume_timeout=RESUME_TIMEOUT_S,
                            before_resume=end_now if lost else flush)
        return future, lost, end_now if lost else None

    def _terminate(self, replica: ReplicaRow) -> None:
        try:
            self.provider(replica.cloud).terminate(replica.instance_id)
        except Exception as err:  # the controller's deadline enforcement retries
            log.warning("ending %s after a passed deadline failed: %s", replica.replica_id, err)

    # ---- the replica's connector ---------------------------------------------------------

    def flush(self, replica: ReplicaRow, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Ask the replica to push its not yet stored KV blocks; True when it confirmed."""
        if not replica.control_endpoint:
            return False
        return flush_kv(self._http, replica.control_endpoint, self._kv_auth(replica.service), timeout_s)

    def _kv_auth(self, service: str) -> dict[str, str]:
        from orchestrator.control.launch import kv_secret_file

        return {"Authorization": f"Bearer {kv_secret_file(service).read_text().strip()}"}

    def _peers(self, service: str) -> list[ReplicaRow]:
        """The replicas the continuations may land on."""
        return [r for r in self.store.list_replicas(service)
                if r.control_endpoint and r.replica_state in (ReplicaState.READY, ReplicaState.NOT_READY)]

    def _stats(self, replica: ReplicaRow) -> dict | None:
        return connector_stats(self._http, replica.control_endpoint, self._kv_auth(replica.service))

    def _kv_outcome(self, peers: list[ReplicaRow], continuations: set[str]) -> KVOutcome:
        """Sum the peers' connector records of these continuations (each record's request id
        carries the X-Request-Id the LB gave the continuation). A busy worker can be slow to
        answer, or to admit: asked again until every continuation has its record."""
        deadline = time.monotonic() + OUTCOME_WAIT_S
        while True:
            answers = [stats for stats in map(self._stats, peers) if stats is not None]
            records = [rec for stats in answers for rec in stats.get("recent_requests", ())
                       if seam_id_in(rec["request_id"]) in continuations]
            if len(records) >= len(continuations) or not answers or time.monotonic() > deadline:
                break  # (no answer at all: no connector on the peers, nothing to wait for)
            time.sleep(0.5)
        return KVOutcome(
            requests=len(records),
            loaded_tokens=sum(rec["loaded_tokens"] for rec in records),
            recomputed_tokens=sum(rec["recomputed_tokens"] for rec in records),
            max_recomputed=max((rec["recomputed_tokens"] for rec in records), default=0),
        )

    # ---- chaos ---------------------------------------------------------------------------

    def chaos_preempt(self, replica_id: str | None, zone: str | None, grace_s: float, service: str | None) -> list[str]:
        """Notices to one replica or every live one in a zone, all sent before any is handled
        (a correlated loss arrives at once), each followed by the kill at its deadline."""
        targets = self._chaos_targets(replica_id, zone, service)
        notices = []
        with self._notices_lock:  # the cloud's feed has them as soon as they are injected
            for r in targets:
                provider = self.provider(r.cloud)
                inject = getattr(provider, "inject_notice", None)
                if inject is not None:
                    notice = inject(r.instance_id, grace_s)
                else:  # a real cloud: our own notice, and we end the instance at its deadline
                    notice = Notice(r.instance_id, NoticeKind.PREEMPT, time.time() + grace_s, source="chaos")
                    threading.Timer(grace_s, provider.terminate, args=(r.instance_id,)).start()
                self.store.record_event(
                    "chaos", service=r.service, replica_id=r.replica_id, location=r.location, market=r.market_enum,
                    message=f"preemption injected, grace {grace_s:.0f}s",
                )
                notices.append((r, Notice(notice.instance_id, notice.kind, notice.deadline, source="chaos")))
            found, services = self._move_streams([n for _r, n in notices])
        self._record_notices(found, services)
        return [r.replica_id for r, _n in notices]

    def _chaos_targets(self, replica_id: str | None, zone: str | None, service: str | None) -> list[ReplicaRow]:
        replicas = [
            r
            for name in ([service] if service else list(self.controllers))
            for r in self.store.list_replicas(name)
            if is_alive(r.replica_state) and r.instance_id
            and r.replica_state not in (ReplicaState.DRAINING, ReplicaState.PENDING, ReplicaState.PROVISIONING)
        ]
        if replica_id:
            found = [r for r in replicas if r.replica_id == replica_id]
            if not found:
                raise UserError(f"no live replica named {replica_id!r} (see `spotctl status`)")
            return found
        found = [r for r in replicas if r.zone == zone]
        if not found:
            raise UserError(f"no live replica in zone {zone!r}")
        return found
