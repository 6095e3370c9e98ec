"""The daemon's Prometheus metrics, served at its GET /metrics (orchestrator.control.api).

Read at scrape time, so no stale series remain: the fleet by state, market, cloud and zone and
its $/hour from the store (`spot_replicas`, `spot_fleet_cost_per_hour`, priced by
orchestrator.control.costing). Counted as they happen, by the controllers (`FleetCounters`):
preemptions, notices and launch failures by kind; by the migrator, in this registry, each
service's spot_migration_*. The daemon makes one `DaemonMetrics` and hands its counters to
every controller and its registry to the migrator, and times its own passes into `passes`
(`spot_daemon_pass_seconds`: one reconcile or probe pass over every service; what tells an
operator the daemon keeps up with its fleet).
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from orchestrator.control import costing
from policies.base import EventKind
from providers.base import AuthError, CapacityError, ProviderError, QuotaError, TransientError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
log = logging.getLogger(__name__)
# Dense below a second: a pass over the whole fleet is meant to stay under one (docs/architecture.md).
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0,
                5.0, 10.0, 30.0)


def failure_kind(err: BaseException) -> str:
    """A launch failure's `kind` label: capacity, quota, auth, transient, error (another
    provider or launcher refusal) or bug (an exception nobody expected)."""
    for kind, cls in (("capacity", CapacityError), ("quota", QuotaError), ("auth", AuthError),
                      ("transient", TransientError), ("error", ProviderError)):
        if isinstance(err, cls):
            return kind
    return "bug"


class FleetCounters:
    """What happened to the fleet, counted by orchestrator.control.controller as it records it."""

    def __init__(self, registry: CollectorRegistry):
        where = ["service", "cloud", "market"]
        self.preemptions = Counter("spot_preemptions", "Replicas the cloud took back", where, registry=registry)
        self.notices = Counter("spot_notices", "Preemption or rebalance notices received", where,
                               registry=registry)
        self.launch_failures = Counter("spot_launch_failures", "Launches that did not give a machine",
                                       ["service", "cloud", "kind"], registry=registry)
        self._by_event = {EventKind.PREEMPTED: self.preemptions, EventKind.NOTICE: self.notices}

    def market_event(self, kind: EventKind, service: str, cloud: str, market: str) -> None:
        counter = self._by_event.get(kind)
        if counter is not None:
            counter.labels(service, cloud, market).inc()

    def launch_failed(self, service: str, cloud: str, err: BaseException) -> None:
        self.launch_failures.labels(service, cloud, failure_kind(err)).inc()


class _FleetCollector:
    """spot_replicas and spot_fleet_cost_per_hour from the store's live replica rows."""

    def __init__(self, store, clock: Callable[[], float] = time.time):
        self._store = store
        self._clock = clock

    def collect(self):
        rows = self._store.list_replicas()  # live rows only: a terminated replica is no series
        replicas = GaugeMetricFamily("spot_replicas", "Live replicas by state, market, cloud and zone",
                                     labels=["service", "state", "market", "cloud", "zone"])
        for key, n in sorted(Tally((r.service, r.state, r.market, r.cloud, r.zone) for r in rows).items()):
            replicas.add_metric(list(key), n)
        yield replicas
        cost = GaugeMetricFamily("spot_fleet_cost_per_hour", "The fleet's $/hour now (prices recorded at launch)",
                                 labels=["service", "market", "cloud"])
        groups: dict[tuple[str, str, str], list] = {}
        for r in rows:
            groups.setdefault((r.service, r.market, r.cloud), []).append(r)
        now = self._clock()
        for key, group in sorted(groups.items()):
            # No quotes asked here: a scrape must not call a cloud; an unpriced replica counts 0.
            report = costing.service_cost(key[0], costing.billed_replicas(group, ()), _no_quote, now)
            cost.add_metric(list(key), report.cost_per_hour)
        yield cost


def _no_quote(*_where) -> None:
    return None


class DaemonMetrics:
    """The daemon's registry: `counters` for the controllers, the migrator's (its `registry`),
    `render` for GET /metrics, followed by `lb_text()`: the data plane's LBs, each sample with
    its service label (empty for load balancers in this process, which serve their own)."""

    def __init__(self, store, lb_text: Callable[[], bytes] = bytes, clock: Callable[[], float] = time.time):
        self.registry = CollectorRegistry()
        self.counters = FleetCounters(self.registry)
        self.passes = Histogram("spot_daemon_pass_seconds", "One reconcile or probe pass over every service",
                                ["job"], buckets=PASS_BUCKETS, registry=self.registry)
        self.registry.register(_FleetCollector(store, clock))
        self._lb_text = lb_text

    def render(self) -> bytes:
        try:
            lbs = self._lb_text()
        except Exception as err:  # the data plane away for a moment: the daemon's own still answer
            log.warning("the data plane's metrics are unavailable: %s", err)
            lbs = b""
        return generate_latest(self.registry) + lbs
