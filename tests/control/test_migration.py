"""The preemption path through the real daemon, fast: notice -> DRAINING -> cut -> continuation.

Real: the daemon's API server and jobs, the local cloud's processes (killed with SIGKILL at
the notice deadline), the service's load balancer, the `spotctl` CLI, the openai client. The
engine is tests/fakes/upstream.py, whose greedy tokens are a function of the token
sequence, so a continuation from prompt + streamed ids must reproduce the uninterrupted run.
It has no KV connector, so the migrator's flush finds no control endpoint (the vllm-marked
tests/e2e/test_migration_vllm.py covers the KV side).
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from orchestrator.lb.continuation import new_seam_id, seam_id_in
from orchestrator.control.launch import ReplicaLauncher
from providers.base import LaunchRequest
from providers.local import LocalProvider
from tests.helpers import FAKES, running_daemon, wait_for
from tests.fakes.migration_harness import (
    daemon_metric,
    Chats,
    busiest,
    chaos,
    check_streams,
    events,
    metric,
    post_notice,
    ready,
    service,
    status,
    wait_ready,
)

FAKE = FAKES / "upstream.py"
SPEC = """
name: mig
service:
  readiness_probe: {path: /health, initial_delay_seconds: 60}
  replicas: 4
  placement_policy: even_spread
resources:
  cloud: local
  use_spot: true
  any_of: [{zone: local-a}, {zone: local-b}, {zone: local-c}]
engine:
  model: tiny
kv:
  enabled: false
"""
STREAMS, MAX_TOKENS, CUT_AT = 16, 250, 10  # ~7.5 s a stream: room for a slow `spotctl`


class FakeUpstreamLauncher(ReplicaLauncher):
    def request(self, spec, row, offer, runtime) -> LaunchRequest:
        return LaunchRequest(
            service=spec.name, replica_id=row.replica_id, location=offer.location, market=offer.market,
            instance_type="",
            command=[sys.executable, str(FAKE), "--port", "{port}", "--name", row.replica_id,
                     "--token-delay", "0.03"],
        )


@pytest.fixture
def daemon(state_home, monkeypatch):
    with running_daemon(monkeypatch, launcher=FakeUpstreamLauncher()) as (d, client):
        client.post("/v1/services", json={"yaml": SPEC}).raise_for_status()
        wait_ready(client, "mig", 4, 120)
        yield d, client


def _reference(endpoint: str) -> list:
    chats = Chats(endpoint, "mig", STREAMS, MAX_TOKENS)
    streams = chats.join()
    assert not [s.error for s in streams if s.error]
    return streams


def _streams_under_way(d, client):
    """The reference run, then the same streams again until each has CUT_AT tokens:
    (LB url, reference, the running chats, the replica with most of them, its count)."""
    svc = service(client, "mig")
    lb_url = svc["endpoint"]
    reference = _reference(lb_url)
    chats = Chats(lb_url, "mig", STREAMS, MAX_TOKENS)
    chats.wait_tokens(CUT_AT)
    victim = busiest(d, "mig", ready(svc))
    return lb_url, reference, chats, victim, d.lbs["mig"].in_flight(victim["replica_id"])


def test_notice_drains_cuts_and_continues_every_stream(daemon):
    d, client = daemon
    # One replica, 3 s grace, through the CLI: every stream goes on, token for token.
    lb_url, reference, chats, victim, in_flight = _streams_under_way(d, client)
    assert in_flight > 0
    assert chaos(victim["replica_id"], "--grace", "3") == [victim["replica_id"]]
    states = {r["replica_id"]: r["state"] for r in service(client, "mig")["replicas"]}
    assert states[victim["replica_id"]] == "DRAINING"  # at once, not at the next tick
    check_streams(chats.join(), reference)
    assert metric(lb_url, 'spot_lb_migrations_total{mode="resume",reason="cut"}') == in_flight
    assert daemon_metric('spot_migration_requests_total{result="resumed",service="mig"}') == in_flight
    assert metric(lb_url, "spot_lb_continuation_failures_total") == 0
    assert metric(lb_url, "spot_lb_migrated_tokens_total") >= CUT_AT * in_flight
    assert metric(lb_url, "spot_lb_stall_seconds_count") == in_flight
    # The fake has no connector: its flush fails.
    assert daemon_metric('spot_migration_flushes_total{result="failed",service="mig"}') == 1

    # At the deadline the local cloud kills it: PREEMPTED, with the story in the events.
    wait_for(lambda: {r["replica_id"]: r["state"] for r in status("mig")["replicas"]}.get(victim["replica_id"])
             == "PREEMPTED", 60, "the victim to be PREEMPTED", 0.5)
    kinds = [e["kind"] for e in events("mig") if e["replica_id"] == victim["replica_id"]]
    assert {"chaos", "notice", "migration", "preempted"} <= set(kinds)
    assert kinds.count("migration") == 1  # the chaos call and the cloud's notice feed: one migration
    migration = next(e for e in events("mig") if e["kind"] == "migration")
    assert f"{in_flight}/{in_flight} streams continued" in migration["message"]

    # A notice whose deadline already passed: an immediate loss, and still no client sees it.
    svc = wait_ready(client, "mig", 4, 120)  # the replacement the notice asked for
    chats = Chats(lb_url, "mig", STREAMS, MAX_TOKENS)
    chats.wait_tokens(CUT_AT)
    victim = busiest(d, "mig", ready(svc))
    in_flight = d.lbs["mig"].in_flight(victim["replica_id"])
    handled = post_notice(client, "mig", victim["instance_id"], deadline=time.time() - 5)
    assert handled["replica_id"] == victim["replica_id"]
    check_streams(chats.join(), reference)
    assert daemon_metric('spot_migration_notices_total{outcome="lost",service="mig"}') == 1
    assert daemon_metric('spot_migration_flushes_total{result="skipped",service="mig"}') == 1
    assert metric(lb_url, "spot_lb_continuation_failures_total") == 0
    wait_for(lambda: {r["replica_id"]: r["state"] for r in service(client, "mig")["replicas"]}.get(
        victim["replica_id"]) in ("PREEMPTED", "TERMINATED"), 60, "the lost replica to be gone", 0.5)
    assert metric(lb_url, 'spot_lb_migrations_total{mode="resume",reason="cut"}') >= in_flight


def test_a_zone_preempted_at_once_loses_no_stream(daemon):
    d, client = daemon
    svc = service(client, "mig")
    lb_url = svc["endpoint"]
    zones = [r["zone"] for r in ready(svc)]
    crowded = max(set(zones), key=zones.count)
    assert zones.count(crowded) == 2  # even_spread: 4 replicas over 3 zones
    reference = _reference(lb_url)
    chats = Chats(lb_url, "mig", STREAMS, MAX_TOKENS)
    chats.wait_tokens(CUT_AT)
    victims = [r["replica_id"] for r in ready(svc) if r["zone"] == crowded]
    cut = sum(d.lbs["mig"].in_flight(v) for v in victims)
    assert sorted(chaos("--zone", crowded, "--grace", "3")) == sorted(victims)
    check_streams(chats.join(), reference)
    # Both were DRAINING before either was cut: no continuation landed on the other victim.
    assert metric(lb_url, 'spot_lb_migrations_total{mode="resume",reason="cut"}') == cut
    assert daemon_metric('spot_migration_requests_total{result="resumed",service="mig"}') == cut
    wait_for(lambda: all(r["state"] == "PREEMPTED" for r in service(client, "mig")["replicas"]
                         if r["replica_id"] in victims), 60, "both victims PREEMPTED", 0.5)


def test_a_notice_from_the_clouds_control_plane_moves_the_streams_too(daemon):
    """Notices the provider reports (spot interruption feeds) reach the migrator through the
    reconcile loop: not only DRAINING, the streams are cut and continued as well."""
    d, client = daemon
    lb_url, reference, chats, victim, in_flight = _streams_under_way(d, client)
    LocalProvider().inject_notice(victim["instance_id"], 3)  # as the cloud would: the daemon is not told
    check_streams(chats.join(), reference)
    assert metric(lb_url, 'spot_lb_migrations_total{mode="resume",reason="cut"}') == in_flight
    assert daemon_metric('spot_migration_notices_total{outcome="drained",service="mig"}') == 1


def test_the_cut_does_not_wait_for_a_busy_controller(daemon):
    """A reconcile pass holds the controller's lock while it launches through a cloud API
    (seconds, on a real cloud). A notice arriving then must still move the streams at once:
    the load balancer drains and cuts first, the controller records DRAINING when it can."""
    d, client = daemon
    lb = d.lbs["mig"]
    lb_url, reference, chats, victim_row, in_flight = _streams_under_way(d, client)
    victim = victim_row["replica_id"]
    assert in_flight > 0

    held, release = threading.Event(), threading.Event()

    def busy_reconcile() -> None:
        with d.controllers["mig"]._lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=busy_reconcile, daemon=True)
    holder.start()
    held.wait(10)
    preempted: list = []
    notice = threading.Thread(target=lambda: preempted.append(chaos(victim, "--grace", "20")), daemon=True)
    notice.start()
    try:
        # While the controller cannot move: no new request for the victim, its streams resumed.
        wait_for(lambda: metric(lb_url, 'spot_lb_migrations_total{mode="resume",reason="cut"}') == in_flight,
                 30, "the victim's streams to be cut and resumed", 0.1)
        assert next(u for u in lb.replicas() if u.replica_id == victim).draining
        assert not preempted and holder.is_alive()  # the controller is still held
        lb.set_replicas(d.controllers["mig"].upstreams())  # a stale view (victim READY) published meanwhile
        assert next(u for u in lb.replicas() if u.replica_id == victim).draining  # drained for good
    finally:
        release.set()
    notice.join(60)
    assert preempted == [[victim]]
    assert {r["replica_id"]: r["state"] for r in service(client, "mig")["replicas"]}[victim] == "DRAINING"
    check_streams(chats.join(), reference)


def test_a_continuations_kv_record_is_found_by_the_id_the_lb_gave_it():
    """vLLM keeps the LB's X-Request-Id inside its own request id; other requests have none."""
    seam = new_seam_id()
    assert seam_id_in(f"cmpl-{seam}-0-a17b2aa8") == seam
    assert seam_id_in(f"chatcmpl-{seam}") == seam
    assert seam_id_in("cmpl-940bebce834a91a4-0-a17b2aa8") is None
    assert seam_id_in("chatcmpl-seam-short-0-1") is None
