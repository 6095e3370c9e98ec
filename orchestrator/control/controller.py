"""reconcile(service): the only place that compares desired replicas with observed ones.

Level-triggered and idempotent: every call reads the store and the provider afresh, so a
missed tick, a crash or a duplicate call changes nothing but timing. One Controller per
service; the daemon calls `reconcile()` and `probe()` from its scheduler jobs and
`handle_notice()` when a notice arrives (through migration.py).

What reconcile does, in order:
1. observe: replicas whose instance is gone become PREEMPTED (spot / noticed) or FAILED;
   SHUTTING_DOWN ones whose instance is gone become TERMINATED;
2. notices the provider's control plane reported are handed to the notice handler;
3. the policy decides launches and removals from the live replicas and the price book;
4. launches go to the provider (capacity errors are market events the policy learns from);
5. the service's status and the load balancer's upstream list follow the replicas.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from orchestrator.fleet import decisions
from orchestrator.lb.proxy import Upstream
from orchestrator.fleet.autoscaler import AutoscalerConfig, RequestRateAutoscaler
from orchestrator.fleet.lifecycle import ReplicaState
from orchestrator.control.launch import ReplicaLauncher
from orchestrator.spec import ServiceSpec, spec_from_json
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
    Instance,
    InstanceStatus,
    Location,
    Market,
    Notice,
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
MARKET_EVENT_KINDS = {k.value for k in EventKind}


class Controller:
    def __init__(
        self,
        service: str,
        store: Store,
        provider: Provider,
        launcher: ReplicaLauncher,
        *,
        policy: PlacementPolicy | None = None,
        offers: Callable[[], Offers] | None = None,
        on_upstreams: Callable[[list[Upstream]], None] | None = None,
        on_notice: Callable[[Notice], object] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.service = service
        self.store = store
        self.provider = provider
        self.launcher = launcher
        self.clock = clock
        self.on_upstreams = on_upstreams
        # The daemon's migrator: a notice from the cloud's control plane must flush and move
        # the replica's streams like one from its agent, not only mark it DRAINING.
        self.on_notice = on_notice or self.handle_notice
        self._offers = offers or (lambda: Offers(self.provider.offers()))
        self.reconciles = 0
        self._lock = threading.RLock()  # jobs, API calls and notices may arrive concurrently
        self._http = httpx.Client(timeout=15.0)
        self._probe_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"probe-{service}")
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

    # ---- inputs -----------------------------------------------------------------------

    def spec(self) -> ServiceSpec:
        row = self.store.get_service(self.service)
        if row is None:
            raise KeyError(f"service {self.service!r} does not exist")
        return spec_from_json(row.spec_json)

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

    def record_requests(self, timestamps: list[float]) -> None:
        self.autoscaler.record_requests(timestamps)

    # ---- the reconcile loop -------------------------------------------------------------

    def reconcile(self) -> None:
        with self._lock:
            svc = self.store.get_service(self.service)
            if svc is None:
                return
            if svc.status == ServiceStatus.SHUTTING_DOWN:
                self._shut_down_all()
                return
            spec = spec_from_json(svc.spec_json)
            instances = self._observe_instances()
            if instances is None:
                return  # the provider could not be read: decide nothing on stale facts
            self._observe_deaths(instances)
            for notice in self._provider_notices():
                self.on_notice(notice)
            self._enforce_drain_deadlines()
            self._apply_policy(spec)
            self._advance_shutdowns(instances)
            self._update_service_status()
            self.publish_upstreams()
            self.reconciles += 1  # completed passes (tests and status pages read it)

    def _observe_instances(self) -> dict[str, Instance] | None:
        try:
            return {i.instance_id: i for i in self.provider.list({TAG_SERVICE: self.service})}
        except ProviderError as err:
            log.warning("service %s: listing instances failed: %s", self.service, err)
            return None

    def _observe_deaths(self, instances: dict[str, Instance]) -> None:
        for r in self.store.list_replicas(self.service):
            state = r.replica_state
            if not r.instance_id or state in (S.PENDING, S.PROVISIONING, S.SHUTTING_DOWN):
                continue
            inst = instances.get(r.instance_id)
            if inst is not None and inst.status is not InstanceStatus.TERMINATED:
                continue
            outcome = decisions.instance_gone(state, r.market_enum)
            if outcome.event is EventKind.PREEMPTED:
                self._apply_outcome(r, outcome, "the instance is gone (reclaimed by the cloud)", "instance gone")
            else:
                self._apply_outcome(r, outcome, "the on-demand instance exited on its own")

    def _provider_notices(self) -> list[Notice]:
        try:
            return self.provider.notices()
        except ProviderError as err:
            log.warning("service %s: reading notices failed: %s", self.service, err)
            return []

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

    def policy_input(self, spec: ServiceSpec) -> PolicyInput:
        offers = Offers(self._offers())
        acc = spec.accelerator
        # Where the service may run: the spec's patterns over what the cloud offers for its
        # accelerator (a region-only or cloud-only spec gets that region's or cloud's zones).
        known = sorted({o.location for o in offers.compatible(acc.name if acc else None)})
        locations = spec.candidate_locations(known=known)
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
            ),
            locations=locations,
            offers=decisions.price_book(offers, locations),
            params=spec.policy_params(),
        )

    def _apply_policy(self, spec: ServiceSpec) -> None:
        decision = self.policy.decide(self.policy_input(spec))
        by_id = {r.replica_id: r for r in self.store.list_replicas(self.service)}
        steps = decisions.plan(decision, lambda rid: by_id[rid].replica_state if rid in by_id else None)
        for removal in steps.removals:
            r = by_id[removal.replica_id]
            outcome = decisions.removed(r.replica_state)
            self._begin_shutdown(r, f"policy: {removal.reason}")
            self.market_event(outcome.event, r, removal.reason)
        for launch in steps.launches:
            self._launch(spec, launch.location, launch.market, launch.reason)

    def _launch(self, spec: ServiceSpec, location: Location, market: Market, reason: str) -> None:
        row = self.store.add_replica(
            self.service, cloud=location.cloud, region=location.region, zone=location.zone, market=market.value
        )
        self.store.record_event(
            "launch", service=self.service, replica_id=row.replica_id, location=location, market=market, message=reason
        )
        row = self._set_state(row, S.PROVISIONING, reason)
        request = self.launcher.request(spec, row, location, market, self.provider.runtime())
        try:
            inst = self.provider.launch(request)
        except ProviderError as err:
            # The replica row stays failed; the next reconcile asks the policy again.
            outcome = decisions.launch_failed(err)
            if outcome.event is EventKind.CAPACITY_ERROR:
                why = f"no capacity: {err}"
            elif isinstance(err, TransientError):
                why = f"transient launch error: {err}"
            else:
                why = f"launch failed: {err}"
            self._apply_outcome(row, outcome, why, str(err))
            return
        self._apply_outcome(
            row,
            decisions.LAUNCH_GRANTED,
            f"instance {inst.instance_id} running",
            reason,
            instance_id=inst.instance_id,
            instance_type=inst.instance_type,
            endpoint=inst.endpoint,
            agent_endpoint=inst.agent_endpoint,
            control_endpoint=inst.control_endpoint,
            launched_at=inst.launched_at,
            price_per_hour=inst.price_per_hour,
        )

    def _begin_shutdown(self, r: ReplicaRow, reason: str) -> None:
        state = decisions.removed(r.replica_state).state
        self._set_state(r, state, reason)
        if state is S.SHUTTING_DOWN and r.instance_id:
            self._terminate(r.instance_id)

    def _terminate(self, instance_id: str) -> None:
        try:
            self.provider.terminate(instance_id)
        except ProviderError as err:
            log.warning("terminate %s failed (will retry): %s", instance_id, err)

    def _advance_shutdowns(self, instances: dict[str, Instance]) -> None:
        for r in self.store.list_replicas(self.service):
            if r.replica_state is not S.SHUTTING_DOWN:
                continue
            inst = instances.get(r.instance_id or "")
            if inst is None or inst.status is InstanceStatus.TERMINATED:
                self._set_state(r, S.TERMINATED, "instance gone")
            else:
                self._terminate(inst.instance_id)

    def _shut_down_all(self) -> None:
        """`down`: terminate everything; the service row goes when every instance is gone."""
        instances = self._observe_instances() or {}
        for r in self.store.list_replicas(self.service):
            if r.replica_state is not S.SHUTTING_DOWN:
                self._begin_shutdown(r, "service is shutting down")
        for inst in instances.values():
            if inst.status is not InstanceStatus.TERMINATED:
                self._terminate(inst.instance_id)
        self._advance_shutdowns(self._observe_instances() or {})
        self.publish_upstreams()

    def finished_shutting_down(self) -> bool:
        instances = self._observe_instances()
        if instances is None:
            return False
        live = [i for i in instances.values() if i.status is not InstanceStatus.TERMINATED]
        return not live and not self.store.list_replicas(self.service)

    def _update_service_status(self) -> None:
        svc = self.store.get_service(self.service)
        if svc is None or svc.status == ServiceStatus.SHUTTING_DOWN:
            return
        replicas = self.store.list_replicas(self.service)
        ready = sum(1 for r in replicas if r.replica_state is S.READY)
        if ready:
            status = ServiceStatus.READY
        elif svc.status in (ServiceStatus.READY, ServiceStatus.NO_REPLICA):
            status = ServiceStatus.NO_REPLICA
        elif replicas:
            status = ServiceStatus.REPLICA_INIT
        else:
            status = svc.status
        if status != svc.status:
            self.store.update_service(self.service, status=status)

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

    def probe(self) -> None:
        """Probe every replica that has an endpoint, in parallel; apply the outcomes."""
        spec_row = self.store.get_service(self.service)
        if spec_row is None:
            return
        probe = spec_from_json(spec_row.spec_json).service.readiness_probe
        targets = [
            r
            for r in self.store.list_replicas(self.service)
            if r.endpoint and r.replica_state in (S.STARTING, S.READY, S.NOT_READY)
        ]
        results = list(self._probe_pool.map(lambda r: (r, self._probe_once(r, probe)), targets))
        with self._lock:
            for r, ok in results:
                current = self.store.get_replica(r.replica_id)
                if current is not None and current.version == r.version:
                    self._apply_probe(current, ok, probe)
            self._update_service_status()
            self.publish_upstreams()

    def _probe_once(self, r: ReplicaRow, probe) -> bool:
        url = r.endpoint.rstrip("/") + probe.path
        try:
            if probe.post_data is not None:
                body = probe.post_data if isinstance(probe.post_data, str) else json.dumps(dict(probe.post_data))
                resp = self._http.post(
                    url,
                    content=body,
                    headers={"Content-Type": "application/json", **dict(probe.headers)},
                    timeout=probe.timeout_seconds,
                )
            else:
                resp = self._http.get(url, headers=dict(probe.headers), timeout=probe.timeout_seconds)
            return resp.status_code == 200
        except httpx.HTTPError:
            return False

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
                    self._terminate(r.instance_id)
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
                self._terminate(r.instance_id)
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
        if self.on_upstreams is not None:
            self.on_upstreams(self.upstreams())

    def close(self) -> None:
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()


def _scalar_qps(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, dict):  # SkyServe allows per-accelerator targets; take the smallest
        return min(float(v) for v in value.values()) if value else None
    return float(value)
