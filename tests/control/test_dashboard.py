"""templates/grafana-dashboard.json is a Grafana dashboard whose every query names metrics the
code exports: the daemon's (with the migrator's), a load balancer's and a shard store's
registries are built in this process and scraped, so a renamed metric fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from orchestrator.control.metrics import DaemonMetrics
from orchestrator.control.migration import MigrationMetrics
from orchestrator.control.store import Store
from orchestrator.lb.proxy import LoadBalancer
from orchestrator.replica.kv.store import StoreHandler

DASHBOARD = Path(__file__).resolve().parents[2] / "templates" / "grafana-dashboard.json"
_METRIC = re.compile(r"\bspot_[a-z0-9_]+\b")
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def exported(*scrapes: bytes) -> set[str]:
    """Every series name a scrape can hold: each TYPE line's name (counters' carry _total),
    with a histogram's _bucket, _sum and _count."""
    names = set()
    for text in scrapes:
        for name, kind in _TYPE.findall(text.decode()):
            names.add(name)
            names.update(name + suffix for suffix in _SUFFIXES.get(kind, ()))
    return names


def test_every_dashboard_query_names_an_exported_metric(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["schemaVersion"] and dashboard["panels"]
    exprs = []
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["type"] and panel["targets"], panel
        exprs += [target["expr"] for target in panel["targets"]]
    lb = LoadBalancer()
    daemon = DaemonMetrics(Store(f"sqlite:///{tmp_path / 'state.db'}"))
    MigrationMetrics(daemon.registry)  # the daemon's migrator counts into the daemon's registry
    names = exported(daemon.render(), lb.metrics.render(), generate_latest(StoreHandler("secret").registry))
    used = {name for expr in exprs for name in _METRIC.findall(expr)}
    assert all(_METRIC.search(expr) for expr in exprs)
    assert used - names == set()
    # It shows all of it: the fleet, its cost, the market's facts, the LB and the shard stores.
    for wanted in ("spot_replicas", "spot_fleet_cost_per_hour", "spot_preemptions_total", "spot_notices_total",
                   "spot_launch_failures_total", "spot_migration_notices_total", "spot_lb_request_seconds_bucket",
                   "spot_lb_request_seconds_count", "spot_lb_time_to_first_token_seconds_bucket",
                   "spot_kv_store_hits_total"):
        assert wanted in used, wanted
