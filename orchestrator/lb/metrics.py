"""Prometheus metrics of one load balancer (its own registry: the daemon runs one LB per service,
and the migrator registers its spot_migration_* metrics in the same registry).

orchestrator.lb.proxy counts into it and serves it at the LB's /metrics. In-flight counts are
read from the LB at scrape time instead of being kept in a Gauge, so the hot path touches one
dict, not a metric object, per request; the per-status histogram children are cached for the
same reason. `forget` drops a replica's series once it leaves the LB's replica set, so a
fleet that churns through spot replicas does not grow the scrape without bound.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

# Gaps between the last token before a seam and the first after it: from a local recompute
# (tens of ms) to a cross-zone KV fetch on a long context (seconds).
STALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Whole requests: a refusal or a cached short answer (ms) to a long stream (minutes).
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# The first streamed bytes: a warm replica's first token (tens of ms) to a long prefill in a queue.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# An OpenAI `usage` object's output count. Matched in the raw bytes, not parsed: the hop has no
# time to decode every answer, and inside generated text the quotes would be escaped.
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def completion_tokens(payload: bytes) -> int | None:
    """The last `usage.completion_tokens` in an answer (or a stream chunk), None without one."""
    found = _COMPLETION_TOKENS.findall(payload)
    return int(found[-1]) if found else None


class _InFlightCollector:
    def __init__(self, snapshot: Callable[[], Mapping[str, int]]):
        self._snapshot = snapshot

    def collect(self):
        family = GaugeMetricFamily("spot_lb_in_flight", "Requests in flight per replica", labels=["replica"])
        for replica, count in sorted(self._snapshot().items()):
            family.add_metric([replica], count)
        yield family


class LBMetrics:
    def __init__(self, in_flight_snapshot: Callable[[], Mapping[str, int]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("spot_lb_requests", "Requests sent to a replica (each try)", ["replica"], registry=r)
        self.errors = Counter("spot_lb_errors", "Failed tries and failed client requests", ["replica", "kind"],
                              registry=r)
        self.retries = Counter("spot_lb_retries", "Tries repeated on another replica", ["reason"], registry=r)
        self.accounting_errors = Counter(
            "spot_lb_accounting_errors", "In-flight decrements without a matching increment (a bug)", registry=r)
        self.migrations = Counter("spot_lb_migrations", "Client streams continued on another replica",
                                  ["reason", "mode"], registry=r)
        self.migrated_tokens = Counter("spot_lb_migrated_tokens",
                                       "Tokens already streamed when a request was continued elsewhere", registry=r)
        self.replayed_tokens = Counter("spot_lb_replayed_tokens",
                                       "Tokens regenerated and skipped by replay continuations", registry=r)
        self.continuation_failures = Counter("spot_lb_continuation_failures",
                                             "Streams that could not be continued (client saw an error)",
                                             ["reason"], registry=r)
        self.stall_seconds = Histogram("spot_lb_stall_seconds",
                                       "Gap between the last token before a seam and the first after it",
                                       buckets=STALL_BUCKETS, registry=r)
        # What the service produced, for `spotctl cost` (cost per million output tokens).
        self.output_tokens = Counter("spot_lb_output_tokens", "Output tokens served to clients", registry=r)
        self.request_seconds = Histogram("spot_lb_request_seconds",
                                         "Client requests from arrival to the last byte, by HTTP status",
                                         ["status"], buckets=REQUEST_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("spot_lb_time_to_first_token_seconds",
                                      "Streamed requests from arrival to the first event sent to the client",
                                      buckets=TTFT_BUCKETS, registry=r)
        self.counting_since = time.time()
        r.register(_InFlightCollector(in_flight_snapshot))
        self._request_children: dict[str, object] = {}
        self._status_children: dict[int, object] = {}

    def count_request(self, replica: str) -> None:
        child = self._request_children.get(replica)
        if child is None:  # labels() costs a lock and a tuple; cache the child per replica
            child = self._request_children[replica] = self.requests.labels(replica)
        child.inc()

    def observe_request(self, status: int, seconds: float) -> None:
        """One client request's latency (proxy.LoadBalancer.app, once per /v1/ request)."""
        child = self._status_children.get(status)
        if child is None:  # a handful of statuses: cached like the per-replica children
            child = self._status_children[status] = self.request_seconds.labels(str(status))
        child.observe(seconds)

    def forget(self, replica_ids) -> None:
        """Drop every series labelled with these replicas (set_replicas, when they leave).
        A request still finishing on one may count it again; those are the rare leftovers."""
        for replica in replica_ids:
            self._request_children.pop(replica, None)
            for metric in (self.requests, self.errors):
                metric.remove_by_labels({"replica": replica})

    def output_tokens_total(self) -> int:
        """Output tokens counted since `counting_since` (read in-process by the daemon)."""
        return int(self.registry.get_sample_value("spot_lb_output_tokens_total") or 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
