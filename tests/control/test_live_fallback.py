"""The default policy live, in the daemon: a correlated preemption (every replica of one
zone at once) brings on-demand cover within one reconcile, and spot comes back once the
domain has been calm for a while. Real daemon, local cloud processes, store and load
balancer; the engine is the stand-in of tests/fakes/engine.py; the policy's windows are
shortened so the test takes seconds, not the production half hour.
"""

from __future__ import annotations

import time

import pytest

from policies.base import load_policy
from policies.hazard_hedge import HazardHedgePolicy
from tests.helpers import running_daemon, wait_for
from tests.control.test_daemon import FakeEngineLauncher

CALM_S = 8.0
SPEC = """
name: live
service:
  readiness_probe: {path: /health, initial_delay_seconds: 60}
  replicas: 4
resources:
  cloud: local
  use_spot: true
  any_of: [{zone: local-a}, {zone: local-b}, {zone: local-c}]
engine: {model: tiny}
kv: {enabled: false}
"""


def short_windows(name: str):
    if name in ("default", "hazard_hedge"):
        return HazardHedgePolicy(storm_window=30.0, calm=CALM_S, preempt_block=CALM_S)
    return load_policy(name)


@pytest.fixture
def daemon(state_home, monkeypatch):
    with running_daemon(monkeypatch, launcher=FakeEngineLauncher(), policy_factory=short_windows) as running:
        yield running


def steady_on_spot(replicas: list[dict]) -> bool:
    ready_spot = [r for r in replicas if r["market"] == "spot" and r["state"] == "READY"]
    return len(ready_spot) >= 4 and not any(r["market"] == "on_demand" for r in replicas)


def live(client) -> list[dict]:
    terminal = {"TERMINATED", "PREEMPTED", "FAILED", "FAILED_PROVISION", "FAILED_PROBING", "FAILED_INITIAL_DELAY"}
    return [r for r in client.get("/v1/services/live").json()["replicas"] if r["state"] not in terminal]


def test_zone_wide_preemption_falls_back_to_on_demand_and_returns_to_spot(daemon):
    d, client = daemon
    client.post("/v1/services", json={"yaml": SPEC}).raise_for_status()
    # Steady state first: 4 READY spot replicas and nothing else (a probe that times out on a
    # loaded machine may briefly bring on-demand cover; it goes once the replica answers).
    wait_for(lambda: steady_on_spot(live(client)), 90, "4 READY spot replicas and no on-demand")
    replicas = live(client)
    by_zone: dict[str, list[str]] = {}
    for r in replicas:
        by_zone.setdefault(r["zone"], []).append(r["replica_id"])
    zone, victims = max(by_zone.items(), key=lambda kv: len(kv[1]))
    assert len(victims) >= 2, f"expected a zone holding 2 of the 4 replicas, got {by_zone}"

    noticed_at = time.monotonic()
    out = client.post("/v1/chaos/preempt", json={"zone": zone, "grace_s": 2}).json()
    assert sorted(out["preempted"]) == sorted(victims)
    # Within one reconcile (the notice itself triggers one): on-demand cover is launching.
    wait_for(lambda: any(r["market"] == "on_demand" for r in live(client)), 5, "on-demand cover")
    assert time.monotonic() - noticed_at < 5
    events = client.get("/v1/events", params={"service": "live", "limit": 500}).json()
    cover = [e for e in events if e["kind"] == "launch" and e["market"] == "on_demand"]
    assert cover, "no on-demand launch event"
    # The victims die at their deadline and are recorded as preempted.
    wait_for(lambda: all(
        r["state"] == "PREEMPTED"
        for r in client.get("/v1/services/live").json()["replicas"] if r["replica_id"] in victims
    ), 30, "the victims to be PREEMPTED")
    # The service never drops below its target of READY replicas for long: cover is up.
    wait_for(lambda: sum(r["state"] == "READY" for r in live(client)) >= 4, 60, "4 READY replicas again")

    # Once the domain is calm, spot comes back and the cover goes.
    wait_for(lambda: steady_on_spot(live(client)), CALM_S + 60, "the service to move back to spot")
    states = {r["replica_id"]: r["state"] for r in client.get("/v1/services/live").json()["replicas"]}
    assert all(states[e["replica_id"]] == "TERMINATED" for e in cover), "the on-demand cover was not removed"
