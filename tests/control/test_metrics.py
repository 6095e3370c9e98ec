"""The daemon's /metrics: the fleet and its $/hour read from the store at scrape time (a replica
gone is a series gone), the controllers' counters, each service's migration counters with a
service label, served without a credential; and one spot_ prefix on every metric in the code."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.control import gate
from orchestrator.control.metrics import DaemonMetrics, FleetCounters, failure_kind
from orchestrator.control.migration import MigrationMetrics
from orchestrator.control.store import Store
from orchestrator.fleet.lifecycle import ReplicaState as S
from orchestrator.lb.proxy import LoadBalancer
from policies.base import EventKind
from providers.base import CapacityError, QuotaError, TransientError
from tests.helpers import running_daemon, wait_for

REPO = Path(__file__).resolve().parents[2]


def samples(text: bytes | str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a Prometheus text scrape."""
    text = text.decode() if isinstance(text, bytes) else text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def launched(store: Store, service: str, zone: str, market: str, price: float | None, cloud: str = "local"):
    row = store.add_replica(service, cloud=cloud, region="local", zone=zone, market=market)
    return store.update_replica(row.replica_id, row.version, state=S.PROVISIONING.value, launched_at=time.time(),
                                price_per_hour=price)


def test_the_fleet_and_its_cost_per_hour_are_read_from_the_store_at_scrape_time(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'state.db'}")
    store.create_or_update_service("svc", "{}")
    launched(store, "svc", "local-a", "spot", 0.5)
    launched(store, "svc", "local-a", "spot", 0.25)
    launched(store, "svc", "local-b", "on_demand", 2.0)
    pending = store.add_replica("svc", cloud="local", region="local", zone="local-b", market="spot")
    metrics = DaemonMetrics(store, {})
    seen = samples(metrics.render())
    where = (("cloud", "local"), ("market", "spot"), ("service", "svc"))
    assert seen[("spot_replicas", tuple(sorted((*where, ("state", "PROVISIONING"), ("zone", "local-a")))))] == 2
    assert seen[("spot_replicas", tuple(sorted((*where, ("state", "PENDING"), ("zone", "local-b")))))] == 1
    assert seen[("spot_fleet_cost_per_hour", where)] == 0.75  # the pending one has no machine yet
    assert seen[("spot_fleet_cost_per_hour", (("cloud", "local"), ("market", "on_demand"), ("service", "svc")))] == 2
    # A terminated replica is no series at all (not a stale 1).
    store.update_replica(pending.replica_id, pending.version, state=S.TERMINATED.value)
    assert not any(dict(labels).get("state") == "PENDING" for name, labels in samples(metrics.render())
                   if name == "spot_replicas")


def test_preemptions_notices_and_launch_failures_are_counted_by_kind():
    counters = FleetCounters(CollectorRegistry())
    counters.market_event(EventKind.PREEMPTED, "svc", "aws", "spot")
    counters.market_event(EventKind.NOTICE, "svc", "aws", "spot")
    counters.market_event(EventKind.READY, "svc", "aws", "spot")  # not a counted fact
    for err in (CapacityError("none"), CapacityError("none"), QuotaError("q"), RuntimeError("bug")):
        counters.launch_failed("svc", "aws", err)
    assert counters.preemptions.labels("svc", "aws", "spot")._value.get() == 1
    assert counters.notices.labels("svc", "aws", "spot")._value.get() == 1
    assert counters.launch_failures.labels("svc", "aws", "capacity")._value.get() == 2
    assert counters.launch_failures.labels("svc", "aws", "bug")._value.get() == 1
    assert failure_kind(TransientError("t")) == "transient" and failure_kind(QuotaError("q")) == "quota"


def test_each_services_migration_counters_show_with_a_service_label(tmp_path):
    daemon = DaemonMetrics(Store(f"sqlite:///{tmp_path / 'state.db'}"))
    migration = MigrationMetrics(daemon.registry)
    migration.notices.labels("a", "drained").inc(2)
    migration.notices.labels("b", "drained").inc(1)
    seen = samples(daemon.render())
    assert seen[("spot_migration_notices_total", (("outcome", "drained"), ("service", "a")))] == 2
    assert seen[("spot_migration_notices_total", (("outcome", "drained"), ("service", "b")))] == 1
    assert not any(name.startswith("spot_lb_") for name, _ in seen)  # in-process LBs serve their own


def test_the_data_planes_lb_metrics_follow_the_daemons_with_a_service_label(tmp_path):
    from orchestrator.lb.admin import labelled_metrics

    lbs = {"a": LoadBalancer(), "b": LoadBalancer()}
    lbs["a"].metrics.output_tokens.inc(5)
    lbs["b"].metrics.output_tokens.inc(7)
    daemon = DaemonMetrics(Store(f"sqlite:///{tmp_path / 'state.db'}"), lambda: labelled_metrics(lbs))
    seen = samples(daemon.render())
    assert seen[("spot_lb_output_tokens_total", (("service", "a"),))] == 5
    assert seen[("spot_lb_output_tokens_total", (("service", "b"),))] == 7
    assert ("spot_replicas" in {name for name, _ in seen}) or "# TYPE spot_replicas gauge" in daemon.render().decode()


def test_the_daemons_metrics_are_the_operators(state_home, monkeypatch):
    # Every service's fleet and $/hour: the operator's token, not a service's replica token.
    assert gate.route_kind("/metrics") == gate.OPERATOR
    with running_daemon(monkeypatch, probe_interval_s=None) as (daemon, client):
        assert httpx.get(f"{daemon.url}/metrics", timeout=30).status_code == 401
        answer = client.get("/metrics", timeout=30)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    assert "# TYPE spot_replicas gauge" in answer.text and "# TYPE spot_preemptions_total counter" in answer.text


def test_the_daemon_times_its_passes_over_every_service(state_home, monkeypatch):
    # An operator's first sign that a large fleet outgrows its daemon: a pass near the interval.
    with running_daemon(monkeypatch, probe_interval_s=0.5) as (_daemon, client):
        def passes() -> dict[str, float]:
            scraped = samples(client.get("/metrics", timeout=30).text)
            return {dict(labels)["job"]: value for (name, labels), value in scraped.items()
                    if name == "spot_daemon_pass_seconds_count"}

        counts = wait_for(lambda: (lambda got: got if min(got.values(), default=0) >= 2 else None)(passes()),
                          30, "two reconcile and two probe passes")
    assert set(counts) == {"reconcile", "probe"}


def _metric_names_in_code() -> dict[str, str]:
    """{name: file} of every metric named by a string literal in orchestrator/: the first
    argument of Counter/Gauge/Histogram/Summary/*MetricFamily, and the name of each
    (name, doc, value) tuple a collector yields."""
    names = {}
    for path in sorted((REPO / "orchestrator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func in ("Counter", "Gauge", "Histogram", "Summary") or func.endswith("MetricFamily"):
                    if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                        names[node.args[0].value] = str(path.relative_to(REPO))
    return names


def test_every_metric_in_the_code_has_the_spot_prefix():
    names = _metric_names_in_code()
    assert {"spot_lb_requests", "spot_replicas", "spot_preemptions", "spot_migration_notices",
            "spot_kv_store_evictions"} <= names.keys()
    assert {n: f for n, f in names.items() if not n.startswith("spot_")} == {}
    # The shard store names its gauges and counters in (name, doc, value) tuples.
    text = (REPO / "orchestrator/replica/kv/store.py").read_text()
    assert '("kv_store_' not in text and '("spot_kv_store_items"' in text
