"""reconcile(service): the only place that compares desired replicas with observed ones.

Level-triggered and idempotent: every call reads the store and the provider afresh, so a
missed tick, a crash or a duplicate call changes nothing but timing. One Controller per
service; the daemon calls `reconcile()` (with its pass's fleet snapshot, control/snapshot.py)
and, for probes, `probe_targets()` and `apply_probes()` around one Prober.check of every
service's replicas (control/prober.py) from its scheduler jobs, and `handle_notice()` when a
notice arrives (through migration.py).

What reconcile does, in order:
1. observe: replicas whose instance is gone become PREEMPTED (spot / noticed) or FAILED;
   SHUTTING_DOWN ones whose instance is gone become TERMINATED;
2. notices the provider's control plane reported are handed to the notice handler;
3. an update in progress (orchestrator.fleet.rollout) hides the replicas being replaced from
   the policy and retires those whose replacements are READY;
   the policy decides launches and removals from the live replicas and the price book;
4. launches go to the provider (capacity errors are market events the policy learns from);
5. the service's status and the load balancer's upstream list follow the replicas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry

from orchestrator.fleet import decisions, rollout
from orchestrator.lb.proxy import Upstream
from orchestrator.fleet.autoscaler import AutoscalerConfig, RequestRateAutoscaler
from orchestrator.common.errors import UserError
from orchestrator.fleet.lifecycle import ReplicaState, is_alive
from orchestrator.control.clouds import Clouds, Observed
from orchestrator.control.launch import ReplicaLauncher
from orchestrator.control.metrics import FleetCounters
from orchestrator.control.prober import Prober, ProbeTarget
from orchestrator.control.snapshot import ServiceReads
from orchestrator.spec import ServiceSpec, spec_from_json
from orchestrator.spec.revision import launch_revision
from orchestrator.control.store import ReplicaRow, ServiceStatus, Store
from policies.base import (
    EventKind,
    MarketEvent,
    PlacementPolicy,
    PolicyInput,
    load_policy,
)
from providers.base import (
    TAG_SERVICE,
    InstanceStatus,
    LaunchRequest,
    Location,
    Market,
    Notice,
    Offer,
    Offers,
    Provider,
    ProviderError,
    TransientError,
)

log = logging.getLogger(__name__)

S = ReplicaState
# A READY replica failing probes this long is torn down (SkyServe's default).
DEFAULT_FAILURE_TIMEOUT_S = 180.0
# Past its notice deadline plus this, a DRAINING replica is terminated by us if the cloud
# has not done it (some clouds' notices are best effort).
DRAIN_OVERRUN_S = 10.0
# Consecutive failed probes before a READY replica counts as NOT_READY (and gets covered).
NOT_READY_AFTER_FAILURES = 2
# A service that was never READY is FAILED after this many of its replicas failed on their own.
FAILED_SERVICE_AFTER = 3
ENGINE_FAILURES = frozenset({ReplicaState.FAILED, ReplicaState.FAILED_INITIAL_DELAY, ReplicaState.FAILED_PROBING})
MARKET_EVENT_KINDS = {k.value for k in EventKind}

# Launches sent to a cloud and not yet recorded, per (store, service), shared by every
# controller of this process: a spec update replaces a service's controller while the old one
# may still be launching, and the new one must not adopt (or fail) that replica meanwhile.
_IN_FLIGHT: set[tuple[str, str]] = set()
_IN_FLIGHT_LOCK = threading.Lock()


class Controller:
    def __init__(
        self,
        service: str,
        store: Store,
        provider: Provider | Clouds,
        launcher: ReplicaLauncher,
        *,
        policy: PlacementPolicy | None = None,
        offers: Callable[[], Offers] | None = None,
        on_upstreams: Callable[[list[Upstream]], None] | None = None,
        on_notice: Callable[[Notice], object] | None = None,
        on_retire: Callable[[list[ReplicaRow]], object] | None = None,
        clock: Callable[[], float] = time.time,
        inline_cloud_calls: bool = False,
        counters: FleetCounters | None = None,
        prober: Prober | None = None,
    ):
        self.service = service
        self._store = store
        self._view = threading.local()  # this thread's pass reads (a snapshot), if any
        # One provider per cloud the service uses (a service may span clouds).
        self.clouds = Clouds.of(provider)
        self.launcher = launcher
        self.clock = clock
        self.on_upstreams = on_upstreams
        # The daemon's migrator: a notice from the cloud's control plane must flush and move
        # the replica's streams like one from its agent, not only mark it DRAINING.
        self.on_notice = on_notice or self.handle_notice
        # The daemon's migrator too: an update's retired replicas have their streams moved
        # first (alone, a controller just shuts them down).
        self.on_retire = on_retire or self._retire_at_once
        # The daemon's /metrics counters; a controller on its own counts into a registry nobody reads.
        self.counters = counters or FleetCounters(CollectorRegistry())
        self._offers = offers or (lambda: Offers(self.clouds.offers()))
        self.reconciles = 0
        self._lock = threading.RLock()  # jobs, API calls and notices may arrive concurrently
        # The daemon's one prober for every service; a controller on its own makes its own.
        self._prober, self._own_prober = (prober, False) if prober is not None else (Prober(), True)
        self._spec: tuple[str, ServiceSpec] | None = None  # (spec_json, parsed): parsed once per spec
        self._published: list[Upstream] | None = None  # the replica set the load balancer has
        # Cloud calls that take seconds (launch, terminate) run on threads of their own, outside the lock,
        # so a notice is never held up by one. Tests that replay a fixed order run them inline.
        self._inline = inline_cloud_calls
        self._terminating: set[str] = set()  # instance ids with a terminate call in flight
        self._pass = threading.Lock()  # one reconcile pass at a time
        self._since = clock()  # failures before this controller (an older spec) do not count
        spec = self.spec()
        self.policy = policy or load_policy(spec.service.placement_policy)
        self._replay_market_events()
        self.autoscaler = RequestRateAutoscaler(
            AutoscalerConfig(
                min_replicas=spec.min_replicas,
                max_replicas=spec.max_replicas,
                target_qps_per_replica=_scalar_qps(spec.service.replica_policy.target_qps_per_replica),
                upscale_delay_s=spec.service.replica_policy.upscale_delay_seconds,
                downscale_delay_s=spec.service.replica_policy.downscale_delay_seconds,
            ),
            now=clock(),
        )

    @property
    def store(self) -> Store:
        """The store; within a pass given a fleet snapshot, that pass's reads of it (its own
        thread only: notices and API calls meanwhile read the store itself)."""
        return getattr(self._view, "reads", None) or self._store

    @contextlib.contextmanager
    def _reading(self, reads: ServiceReads | None) -> Iterator[None]:
        self._view.reads = reads
        try:
            yield
        finally:
            self._view.reads = None

    # ---- inputs -----------------------------------------------------------------------

    def spec(self) -> ServiceSpec:
        row = self.store.get_service(self.service)
        if row is None:
            raise KeyError(f"service {self.service!r} does not exist")
        cached = self._spec
        if cached is None or cached[0] != row.spec_json:
            cached = self._spec = (row.spec_json, spec_from_json(row.spec_json))
        return cached[1]

    def _replay_market_events(self) -> None:
        """Rebuild the policy's view (a fold over market events) from the events table."""
        for ev in self.store.list_events(service=self.service, kinds=sorted(MARKET_EVENT_KINDS)):
            if ev.cloud and ev.market:
                self.policy.observe(
                    MarketEvent(
                        kind=EventKind(ev.kind),
                        location=Location(ev.cloud, ev.region or "", ev.zone or ""),
                        market=Market(ev.market),
                        at=ev.at,
                        replica_id=ev.replica_id,
                    )
                )

    def market_event(self, kind: EventKind, replica: ReplicaRow, message: str = "", at: float | None = None) -> None:
        """Record a market event and show it to the policy: the two always go together."""
        at = self.clock() if at is None else at
        self.store.record_event(
            kind.value,
            service=self.service,
            replica_id=replica.replica_id,
            location=replica.location,
            market=replica.market_enum,
            message=message,
            at=at,
        )
        self.policy.observe(MarketEvent(kind, replica.location, replica.market_enum, at, replica.replica_id))
        self.counters.market_event(kind, self.service, replica.cloud, replica.market)

    def record_requests(self, timestamps: list[float]) -> None:
        self.autoscaler.record_requests(timestamps)

    # ---- the reconcile loop -------------------------------------------------------------

    def reconcile(self, reads: ServiceReads | None = None) -> None:
        """One pass. The cloud calls (list, notices, launches) run outside the lock that
        notices take, so a notice never waits for a launch; a pass already running (a slow
        launch) makes this one a no-op. `reads`: the daemon's fleet snapshot for this pass."""
        if not self._pass.acquire(blocking=False):
            return
        try:
            with self._reading(reads):
                self._reconcile()
        finally:
            self._pass.release()

    def _reconcile(self) -> None:
        svc = self.store.get_service(self.service)
        if svc is None:
            return
        if svc.status == ServiceStatus.SHUTTING_DOWN:
            self._shut_down_all()
            return
        instances = self._observe_instances()
        if instances is None:
            return  # the provider could not be read: decide nothing on stale facts
        notices = self._provider_notices()
        with self._lock:
            self._settle_unrecorded(instances)
            self._observe_deaths(instances)
            self._observe_endpoints(instances)
        for notice in notices:
            self.on_notice(notice)
        with self._lock:
            spec = self.spec()
            self._enforce_drain_deadlines()
            update = self._update_step(spec, svc.update_mode)
            retiring = self._retire(update.retire) if update is not None else []
            # A FAILED service launches nothing more until a new spec (each launch would fail too).
            hidden = update.hidden if update is not None else frozenset()
            launches = self._apply_policy(spec, hidden) if svc.status != ServiceStatus.FAILED else []
            self._advance_shutdowns(instances)
            self._update_service_status()
            self.publish_upstreams()
        if retiring:
            self.on_retire(retiring)
        self.carry_out(launches)
        self.reconciles += 1  # completed passes (tests and status pages read it)

    def steady(self, reads: Store | None = None) -> bool:
        """Whether a pass now would only wait: the service READY, no update rolling, no
        request-rate autoscaling (its target moves with traffic, not with the rows), every live
        replica READY with no cloud call in flight. Daemon.reconcile_service asks after a pass
        that wrote nothing, to reconcile such a service less often."""
        store = reads or self.store
        svc = store.get_service(self.service)
        if svc is None or svc.status != ServiceStatus.READY or svc.update_mode \
                or self.autoscaler.config.target_qps_per_replica or self._terminating:
            return False
        return all(r.replica_state == S.READY and not self._in_flight(r.replica_id)
                   for r in store.list_replicas(self.service))

    def regions(self) -> dict[str, list[str]]:
        """Per cloud, the regions this service's instances may be in: its candidates' and its
        replicas' (only those are listed: another region may not even be enabled)."""
        known = {(r.cloud, r.region) for r in self.store.list_replicas(self.service, include_terminal=True)
                 if r.region}
        try:
            spec = self.spec()
            known |= {(loc.cloud, loc.region) for loc in spec.candidate_locations(self._known_locations(spec))}
        except KeyError:
            pass
        out: dict[str, list[str]] = {}
        for cloud, region in sorted(known):
            out.setdefault(cloud, []).append(region)
        return out

    def _known_locations(self, spec: ServiceSpec, offers: Offers | None = None) -> list[Location]:
        # Where the service may run: the spec's patterns over what the cloud offers for its
        # accelerator (a region-only or cloud-only spec gets that region's or cloud's zones).
        offers = Offers(self._offers()) if offers is None else offers
        return sorted({o.location for o in offers if decisions.fits(o, spec)})

    def _observe_instances(self) -> Observed | None:
        observed = self.clouds.list({TAG_SERVICE: self.service}, self.regions())
        if observed is None:
            log.warning("service %s: no cloud could list its instances", self.service)
        return observed

    def _in_flight(self, replica_id: str) -> bool:
        with _IN_FLIGHT_LOCK:
            return (self.store.url, replica_id) in _IN_FLIGHT

    def _mark_in_flight(self, replica_id: str, on: bool) -> None:
        with _IN_FLIGHT_LOCK:
            (_IN_FLIGHT.add if on else _IN_FLIGHT.discard)((self.store.url, replica_id))

    def _settle_unrecorded(self, instances: Observed) -> None:
        """What a daemon killed mid-launch left behind. An instance of this incarnation that no
        replica row names is adopted by its replica when that one is still waiting for it
        (PENDING/PROVISIONING, no instance), else terminated (its slot is taken or gone). A
        waiting replica with no launch in flight and no instance never got one: it failed.
        Instances of other incarnations are the daemon's orphan sweep's."""
        incarnation = self._incarnation()
        rows = {r.replica_id: r for r in self.store.list_replicas(self.service, include_terminal=True)}
        known = {r.instance_id for r in rows.values() if r.instance_id}
        claimed: set[str] = set()
        for inst in instances:
            if inst.status in (InstanceStatus.TERMINATED, InstanceStatus.STOPPING) or inst.instance_id in known:
                continue
            if (inst.incarnation or "") not in ("", incarnation):
                continue
            row = rows.get(inst.replica_id or "")
            if row is not None and self._in_flight(row.replica_id):
                continue  # its launch is recording it now
            if (row is not None and row.instance_id is None and row.replica_id not in claimed
                    and row.replica_state in (S.PENDING, S.PROVISIONING)):
                claimed.add(row.replica_id)
                self._adopt(row, inst)
                continue
            if inst.instance_id in self._terminating:
                continue
            log.warning("service %s: instance %s (replica %s) has no replica waiting for it; terminating",
                        self.service, inst.instance_id, inst.replica_id)
            self.store.record_event("orphan_terminated", service=self.service, replica_id=inst.replica_id,
                                    location=inst.location, market=inst.market,
                                    message=f"instance {inst.instance_id}: its replica's slot is taken")
            self._terminate(inst.location.cloud, inst.instance_id)
        for r in self.store.list_replicas(self.service):
            if (r.replica_state in (S.PENDING, S.PROVISIONING) and not r.instance_id
                    and r.replica_id not in claimed and not self._in_flight(r.replica_id)
                    and not instances.unknown_at(r.cloud, r.region)):
                state = S.TERMINATED if r.replica_state is S.PENDING else S.FAILED_PROVISION
                self._set_state(r, state, "its launch was interrupted (daemon restart) and made no instance")

    def _adopt(self, row: ReplicaRow, inst) -> None:
        if row.replica_state is S.PENDING:
            row = self._set_state(row, S.PROVISIONING, "adopting the instance its launch made")
        self._apply_outcome(
            row, decisions.LAUNCH_GRANTED, f"instance {inst.instance_id} adopted (launched, not recorded)",
            "adopted after a daemon restart", instance_id=inst.instance_id,
            instance_type=inst.instance_type or row.instance_type, endpoint=inst.endpoint,
            agent_endpoint=inst.agent_endpoint, control_endpoint=inst.control_endpoint,
            launched_at=inst.launched_at, price_per_hour=inst.price_per_hour or row.price_per_hour,
        )
        log.info("service %s: adopted instance %s as %s", self.service, inst.instance_id, row.replica_id)

    def _incarnation(self) -> str:
        row = self.store.get_service(self.service)
        return row.incarnation if row is not None else ""

    def _observe_deaths(self, instances: Observed) -> None:
        for r in self.store.list_replicas(self.service):
            state = r.replica_state
            if not r.instance_id or state in (S.PENDING, S.PROVISIONING, S.SHUTTING_DOWN):
                continue
            if instances.unknown_at(r.cloud, r.region):
                continue  # its region could not be read this pass: unknown, not gone
            inst = instances.by_id().get(r.instance_id)
            if inst is not None and inst.status is not InstanceStatus.TERMINATED:
                continue
            outcome = decisions.instance_gone(state, r.market_enum)
            if outcome.event is EventKind.PREEMPTED:
                self._apply_outcome(r, outcome, "the instance is gone (reclaimed by the cloud)", "instance gone")
            else:
                self._apply_outcome(r, outcome, "the on-demand instance exited on its own")

    def _observe_endpoints(self, instances: Observed) -> None:
        """A VM's address is known only once it runs (Azure's not even at launch): take the
        endpoints the provider reports now, so probes and the load balancer can reach it."""
        for r in self.store.list_replicas(self.service):
            inst = instances.by_id().get(r.instance_id or "")
            if inst is None or not is_alive(r.replica_state):
                continue
            fresh = {k: v for k, v in (("endpoint", inst.endpoint), ("agent_endpoint", inst.agent_endpoint),
                                       ("control_endpoint", inst.control_endpoint))
                     if v and v != getattr(r, k)}
            if fresh:
                self.store.update_replica(r.replica_id, r.version, **fresh)

    def _provider_notices(self) -> list[Notice]:
        return self.clouds.notices()

    def handle_notice(self, notice: Notice) -> ReplicaRow | None:
        """Mark the replica DRAINING (idempotent) and record the notice; the migration
        layer (orchestrator.control.migration) does the rest. Returns the replica, or None when the
        notice is for an instance of another service / already dead."""
        with self._lock:
            replica = self._replica_for_instance(notice.instance_id)
            if replica is None:
                return None
            outcome = decisions.notice_arrived(replica.replica_state)
            if outcome.state is None:
                # Already draining (a repeat: still ours to migrate), or not running yet
                # (the death will be observed) / dead.
                return replica if replica.replica_state is S.DRAINING else None
            replica = self._apply_outcome(
                replica,
                outcome,
                f"{notice.kind.value} notice from {notice.source or 'provider'}",
                f"{notice.kind.value}, deadline {notice.deadline:.0f}",
                notice_deadline=notice.deadline,
            )
            self.publish_upstreams()
            return replica

    def _replica_for_instance(self, instance_id: str) -> ReplicaRow | None:
        for r in self.store.list_replicas(self.service):
            if r.instance_id == instance_id:
                return r
        return None

    def _enforce_drain_deadlines(self) -> None:
        now = self.clock()
        for r in self.store.list_replicas(self.service):
            if r.replica_state is S.DRAINING and r.notice_deadline and now > r.notice_deadline + DRAIN_OVERRUN_S:
                self._begin_shutdown(r, "notice deadline passed; terminating")

    # ---- updates (orchestrator.fleet.rollout) -------------------------------------------------

    def _update_step(self, spec: ServiceSpec, mode: str | None) -> rollout.Step | None:
        """The update's step this pass (None: no update in progress); records its end."""
        if mode is None:
            return None
        revision = launch_revision(spec)
        members = [rollout.Member(r.replica_id, r.replica_state, r.spec_revision)
                   for r in self.store.list_replicas(self.service)]
        step = rollout.step(members, revision, self.autoscaler.target(self.clock()), mode)
        if step.done:
            self.store.update_service(self.service, update_mode=None)
            self.store.record_event("update_finished", service=self.service,
                                    message=f"{mode} update to revision {revision} finished: {step.new} replica(s)",
                                    data={"mode": mode, "revision": revision, "new": step.new})
            return None
        return step

    def _retire(self, replica_ids: tuple[str, ...]) -> list[ReplicaRow]:
        """Retire the update's replicas: those that may carry streams are returned, for
        `on_retire` (the migrator) to move them first; the rest are shut down now."""
        serving = []
        for replica_id in replica_ids:
            r = self.store.get_replica(replica_id)
            if r is None:
                continue
            if r.instance_id and r.replica_state in (S.READY, S.NOT_READY):
                serving.append(r)
            else:
                self.finish_retire(r)
        return serving

    def mark_retiring(self, replica: ReplicaRow, deadline: float) -> ReplicaRow | None:
        """DRAINING for an update (the migrator calls it once the LB drained it): like a notice's,
        with `deadline` as the backstop, but no market event: the market said nothing."""
        with self._lock:
            r = self.store.get_replica(replica.replica_id)
            if r is None or r.replica_state not in (S.READY, S.NOT_READY):
                return None  # already shut down (nothing was in flight), or noticed meanwhile
            r = self._set_state(r, S.DRAINING, "replaced by an update: moving its streams",
                                notice_deadline=deadline)
            self.publish_upstreams()
            return r

    def finish_retire(self, replica: ReplicaRow) -> None:
        """Terminate an update's replica once its streams moved (the migrator calls it)."""
        with self._lock:
            r = self.store.get_replica(replica.replica_id)
            if r is None or r.replica_state is S.SHUTTING_DOWN or not is_alive(r.replica_state):
                return
            self._begin_shutdown(r, "replaced by an update")
            # So the policy forgets it, as after a removal of its own.
            self.market_event(decisions.removed(r.replica_state).event, r, "replaced by an update")
            self.store.record_event("replica_replaced", service=self.service, replica_id=r.replica_id,
                                    location=r.location, market=r.market_enum,
                                    message=f"launched from revision {r.spec_revision or '?'}; replaced by an update",
                                    data={"revision": r.spec_revision})
            self.publish_upstreams()

    def _retire_at_once(self, replicas: list[ReplicaRow]) -> None:
        for r in replicas:
            self.finish_retire(r)

    def policy_input(self, spec: ServiceSpec, hidden: frozenset[str] = frozenset()) -> PolicyInput:
        offers = Offers(self._offers())
        locations = spec.candidate_locations(known=self._known_locations(spec, offers))
        return decisions.policy_input(
            now=self.clock(),
            target=self.autoscaler.target(self.clock()),
            replicas=(
                decisions.replica_view(
                    r.replica_id,
                    r.location,
                    r.market_enum,
                    r.replica_state,
                    r.launched_at if r.launched_at is not None else r.created_at,
                    r.notice_deadline,
                    r.ready_at,
                )
                for r in self.store.list_replicas(self.service)
                if r.replica_id not in hidden
            ),
            locations=locations,
            offers=decisions.price_book(offers, locations),
            params=spec.policy_params(),
        )

    def _apply_policy(self, spec: ServiceSpec, hidden: frozenset[str] = frozenset()) -> list[PendingLaunch]:
        """Carry out the policy's decision in the store, without the `hidden` replicas (an
        update's, being replaced); returns the launches still to be sent to the cloud
        (`carry_out`, outside the lock)."""
        view = self.policy_input(spec, hidden)
        decision = self.policy.decide(view)
        by_id = {r.replica_id: r for r in self.store.list_replicas(self.service)}
        steps = decisions.plan(decision, lambda rid: by_id[rid].replica_state if rid in by_id else None)
        for removal in steps.removals:
            r = by_id[removal.replica_id]
            outcome = decisions.removed(r.replica_state)
            self._begin_shutdown(r, f"policy: {removal.reason}")
            self.market_event(outcome.event, r, removal.reason)
        pending = []
        for launch in steps.launches:
            offer = decisions.offer_for(launch, view.offers, spec)
            if offer is None:
                log.warning("service %s: no %s offer in %s for %s; launch skipped", self.service,
                            launch.market.value, launch.location, spec.accelerators_wanted() or "the spec")
                continue
            job = self._launch(spec, offer, launch.reason)
            if job is not None:
                pending.append(job)
        return pending

    def carry_out(self, launches: list[PendingLaunch]) -> None:
        """Send the launches to the cloud, in parallel, and record each outcome."""
        if len(launches) == 1 or self._inline:
            for job in launches:
                self._carry_out_launch(*job)
        elif launches:
            for thread in [self._in_background(self._carry_out_launch, *job) for job in launches]:
                thread.join()

    def _launch(self, spec: ServiceSpec, offer: Offer, reason: str) -> PendingLaunch | None:
        """Record the replica (PROVISIONING) and build its request; the cloud call comes after
        (`carry_out`), and the policy counts the replica as launching meanwhile."""
        location, market = offer.location, offer.market
        row = self.store.add_replica(
            self.service, cloud=location.cloud, region=location.region, zone=location.zone, market=market.value,
            spec_revision=launch_revision(spec),
        )
        self.store.record_event(
            "launch", service=self.service, replica_id=row.replica_id, location=location, market=market,
            message=f"{reason} ({offer.instance_type}, ${offer.price_per_hour:.4f}/h)",
        )
        self._mark_in_flight(row.replica_id, True)
        row = self._set_state(row, S.PROVISIONING, reason, instance_type=offer.instance_type,
                              price_per_hour=offer.price_per_hour)
        try:
            request = self.launcher.request(spec, row, offer, self.clouds.provider(location.cloud).runtime())
        except UserError as err:  # e.g. the demo model could not be built: a failed launch, said once
            self.counters.launch_failed(self.service, location.cloud, err)
            self._apply_outcome(row, decisions.launch_failed(ProviderError(str(err))), f"launch failed: {err}")
            self._mark_in_flight(row.replica_id, False)
            return None
        # Every launcher's request carries the incarnation (tags and idempotency token).
        return row, dataclasses.replace(request, incarnation=self._incarnation()), reason

    def _carry_out_launch(self, row: ReplicaRow, request: LaunchRequest, reason: str) -> None:
        try:
            self._send_launch(row, request, reason)
        finally:
            self._mark_in_flight(row.replica_id, False)

    def _send_launch(self, row: ReplicaRow, request: LaunchRequest, reason: str) -> None:
        try:
            inst = self.clouds.provider(request.location.cloud).launch(request)
        except ProviderError as err:
            # The replica row stays failed; the next reconcile asks the policy again.
            self.counters.launch_failed(self.service, request.location.cloud, err)
            outcome = decisions.launch_failed(err)
            if outcome.event is EventKind.CAPACITY_ERROR:
                why = f"no capacity: {err}"
            elif isinstance(err, TransientError):
                why = f"transient launch error: {err}"
            else:
                why = f"launch failed: {err}"
            with self._lock:
                self._apply_outcome(self._current(row), outcome, why, str(err))
            return
        except Exception as err:  # a provider bug must not leave the replica PROVISIONING forever
            log.exception("service %s: launch of %s failed", self.service, row.replica_id)
            self.counters.launch_failed(self.service, request.location.cloud, err)
            with self._lock:
                self._apply_outcome(self._current(row), decisions.launch_failed(ProviderError(str(err))),
                                    f"launch failed: {type(err).__name__}: {err}")
            return
        with self._lock:
            current = self._current(row)
            if current.replica_state is not S.PROVISIONING:  # removed (or `down`) while launching
                self._terminate(request.location.cloud, inst.instance_id)
                self.store.update_replica(current.replica_id, current.version, instance_id=inst.instance_id)
                return
            self._apply_outcome(
                current,
                decisions.LAUNCH_GRANTED,
                f"instance {inst.instance_id} running",
                reason,
                instance_id=inst.instance_id,
                instance_type=inst.instance_type or request.instance_type,
                endpoint=inst.endpoint,
                agent_endpoint=inst.agent_endpoint,
                control_endpoint=inst.control_endpoint,
                launched_at=inst.launched_at,
                price_per_hour=inst.price_per_hour or request.price_per_hour,
            )
            self.publish_upstreams()

    def _current(self, row: ReplicaRow) -> ReplicaRow:
        return self.store.get_replica(row.replica_id) or row

    def _begin_shutdown(self, r: ReplicaRow, reason: str) -> None:
        state = decisions.removed(r.replica_state).state
        self._set_state(r, state, reason)
        if state is S.SHUTTING_DOWN and r.instance_id:
            self._terminate(r.cloud, r.instance_id)

    def _terminate(self, cloud: str, instance_id: str) -> None:
        """Terminate in the background, once at a time per instance (every pass asks again
        until the instance is gone)."""
        if instance_id in self._terminating:
            return
        self._terminating.add(instance_id)

        def job() -> None:
            try:
                self.clouds.provider(cloud).terminate(instance_id)
            except ProviderError as err:
                log.warning("terminate %s failed (will retry): %s", instance_id, err)
            except Exception:
                log.exception("terminate %s failed (will retry)", instance_id)
            finally:
                self._terminating.discard(instance_id)

        if self._inline:
            job()
        else:
            self._in_background(job)

    def _in_background(self, call: Callable[..., object], *args) -> threading.Thread:
        """A cloud call on a thread of its own, gone when the call ends: a pool per service kept
        its idle threads for good (four per 4-replica service, thousands in a large fleet), and
        one pool for all would let a slow cloud hold up every other service's launches."""
        thread = threading.Thread(target=call, args=args, name=f"cloud-{self.service}", daemon=True)
        thread.start()
        return thread

    def _advance_shutdowns(self, instances: Observed) -> None:
        for r in self.store.list_replicas(self.service):
            if r.replica_state is not S.SHUTTING_DOWN or instances.unknown_at(r.cloud, r.region):
                continue
            inst = instances.by_id().get(r.instance_id or "")
            if inst is None or inst.status is InstanceStatus.TERMINATED:
                self._set_state(r, S.TERMINATED, "instance gone")
            else:
                self._terminate(r.cloud, inst.instance_id)

    def _shut_down_all(self) -> None:
        """`down`: terminate everything; the service row goes when every instance is gone."""
        instances = self._observe_instances() or Observed()
        with self._lock:
            for r in self.store.list_replicas(self.service):
                if r.replica_state is not S.SHUTTING_DOWN:
                    self._begin_shutdown(r, "service is shutting down")
        for inst in instances:
            if inst.status is not InstanceStatus.TERMINATED:
                self._terminate(inst.location.cloud, inst.instance_id)
        after = self._observe_instances() or Observed()
        with self._lock:
            self._advance_shutdowns(after)
            self.publish_upstreams()

    def finished_shutting_down(self) -> bool:
        instances = self._observe_instances()
        if instances is None or instances.unknown:
            return False
        live = [i for i in instances if i.status is not InstanceStatus.TERMINATED]
        return not live and not self.store.list_replicas(self.service)

    def _update_service_status(self) -> None:
        svc = self.store.get_service(self.service)
        if svc is None or svc.status == ServiceStatus.SHUTTING_DOWN:
            return
        replicas = self.store.list_replicas(self.service)
        ready = sum(1 for r in replicas if r.replica_state is S.READY)
        if ready:
            status = ServiceStatus.READY
        elif svc.status == ServiceStatus.FAILED or self._engine_keeps_failing(svc):
            status = ServiceStatus.FAILED  # until `spotctl up` brings a new spec
        elif svc.status in (ServiceStatus.READY, ServiceStatus.NO_REPLICA):
            status = ServiceStatus.NO_REPLICA
        elif replicas:
            status = ServiceStatus.REPLICA_INIT
        else:
            status = svc.status
        if status != svc.status:
            self.store.update_service(self.service, status=status)

    def _engine_keeps_failing(self, svc) -> bool:
        """Never READY under this spec, and FAILED_SERVICE_AFTER of its replicas failed on their
        own (the engine exited or never got ready: the spec's fault, which a relaunch repeats)."""
        if svc.status not in (ServiceStatus.PENDING, ServiceStatus.REPLICA_INIT):
            return False
        failed = [r for r in self.store.list_replicas(self.service, include_terminal=True)
                  if r.replica_state in ENGINE_FAILURES and r.created_at >= self._since]
        return len(failed) >= FAILED_SERVICE_AFTER

    def _set_state(self, r: ReplicaRow, state: ReplicaState, reason: str, **fields) -> ReplicaRow:
        return self.store.update_replica(r.replica_id, r.version, reason=reason, state=state.value, **fields)

    def _apply_outcome(
        self, r: ReplicaRow, outcome: decisions.Outcome, reason: str, event_message: str = "", **fields
    ) -> ReplicaRow:
        """Carry out a fact's consequence (orchestrator.fleet.decisions): the state change, then
        the market event, if any."""
        if outcome.state is not None:
            r = self._set_state(r, outcome.state, reason, **fields)
        elif fields:
            r = self.store.update_replica(r.replica_id, r.version, **fields)
        if outcome.event is not None:
            self.market_event(outcome.event, r, event_message or reason)
        return r

    # ---- readiness probes -------------------------------------------------------------

    def probe(self, reads: ServiceReads | None = None) -> None:
        """Probe every replica that has an endpoint, all at once; apply the outcomes."""
        targets = self.probe_targets(reads)
        oks = self._prober.check([target for _, target in targets])
        self.apply_probes([(r, ok) for (r, _), ok in zip(targets, oks, strict=True)], reads)

    def probe_targets(self, reads: ServiceReads | None = None) -> list[tuple[ReplicaRow, ProbeTarget]]:
        """The replicas to probe now (starting or serving, with an endpoint), each with its
        check; the daemon sends every service's together (Prober.check)."""
        with self._reading(reads):
            try:
                probe = self.spec().service.readiness_probe
            except KeyError:
                return []
            return [(r, ProbeTarget.of(r.endpoint, probe)) for r in self.store.list_replicas(self.service)
                    if r.endpoint and r.replica_state in (S.STARTING, S.READY, S.NOT_READY)]

    def apply_probes(self, results: list[tuple[ReplicaRow, bool]], reads: ServiceReads | None = None) -> None:
        """Each probed replica's outcome, unless its row changed meanwhile; then the service's
        status and the load balancer's upstreams follow."""
        with self._reading(reads), self._lock:
            try:
                probe = self.spec().service.readiness_probe
            except KeyError:
                return
            for r, ok in results:
                current = self.store.get_replica(r.replica_id)
                if current is not None and current.version == r.version:
                    self._apply_probe(current, ok, probe)
            self._update_service_status()
            self.publish_upstreams()

    def _apply_probe(self, r: ReplicaRow, ok: bool, probe) -> None:
        now = self.clock()
        state = r.replica_state
        if ok:
            if state in (S.STARTING, S.NOT_READY):
                self._apply_outcome(
                    r, decisions.became_ready(state), "readiness probe succeeded", "first probe succeeded",
                    ready_at=r.ready_at or now, last_probe_ok_at=now, consecutive_probe_failures=0,
                )
            elif r.consecutive_probe_failures:
                self.store.update_replica(r.replica_id, r.version, consecutive_probe_failures=0, last_probe_ok_at=now)
            return
        if state is S.STARTING:
            if now - (r.launched_at or r.created_at) > probe.initial_delay_seconds:
                self._set_state(r, S.FAILED_INITIAL_DELAY, f"not ready after {probe.initial_delay_seconds:.0f}s")
                if r.instance_id:
                    self._terminate(r.cloud, r.instance_id)
            return
        failures = r.consecutive_probe_failures + 1
        if state is S.READY:
            if failures >= NOT_READY_AFTER_FAILURES:
                self._set_state(r, S.NOT_READY, f"{failures} readiness probes failed",
                                consecutive_probe_failures=failures)
            else:  # one slow answer on a busy machine is not an outage: no cover launched for it
                self.store.update_replica(r.replica_id, r.version, consecutive_probe_failures=failures)
            return
        timeout = probe.consecutive_failure_threshold_timeout or DEFAULT_FAILURE_TIMEOUT_S
        if now - (r.last_probe_ok_at or r.ready_at or now) > timeout:
            self._set_state(r, S.FAILED_PROBING, f"probes failing for over {timeout:.0f}s")
            if r.instance_id:
                self._terminate(r.cloud, r.instance_id)
        else:
            self.store.update_replica(r.replica_id, r.version, consecutive_probe_failures=failures)

    # ---- load balancer feed ------------------------------------------------------------

    def upstreams(self) -> list[Upstream]:
        return [
            Upstream(
                replica_id=r.replica_id,
                url=r.endpoint,
                ready=r.replica_state is S.READY,
                draining=r.replica_state is S.DRAINING,
            )
            for r in self.store.list_replicas(self.service)
            if r.endpoint and r.replica_state in (S.READY, S.NOT_READY, S.DRAINING)
        ]

    def publish_upstreams(self) -> None:
        """Tell the load balancer the replica set, when it changed since the last one it took
        (every pass and probe round asks: a large fleet's LBs would re-check thousands of
        unchanged URLs a second). Called under the controller's lock."""
        if self.on_upstreams is None:
            return
        upstreams = self.upstreams()
        if upstreams != self._published:
            self.on_upstreams(upstreams)
            self._published = upstreams

    def close(self) -> None:
        if self._own_prober:
            self._prober.close()


PendingLaunch = tuple[ReplicaRow, LaunchRequest, str]  # (its PROVISIONING row, the request, the reason)


def _scalar_qps(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, dict):  # SkyServe allows per-accelerator targets; take the smallest
        return min(float(v) for v in value.values()) if value else None
    return float(value)
