"""One preemption, one replacement and at most one cover, live: a real daemon, the local
cloud's processes and the stand-in engine with a cold start longer than the notice (the
case where a second replacement and a second cover used to follow at the deadline)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.control.test_daemon import FakeEngineLauncher
from tests.control.test_live_fallback import SPEC as FALLBACK_SPEC
from tests.helpers import running_daemon, wait_for

COLD_START_S = 6.0
GRACE_S = 2.0
SPEC = FALLBACK_SPEC.replace("name: live", "name: churn").replace("replicas: 4", "replicas: 2")


class SlowEngineLauncher(FakeEngineLauncher):
    """The stand-in engine, answering /health only COLD_START_S after it starts."""

    def request(self, spec, row, location, market):
        request = super().request(spec, row, location, market)
        return dataclasses.replace(request, command=[*request.command, "--ready-after", str(COLD_START_S)])


@pytest.fixture
def daemon(state_home, monkeypatch):
    with running_daemon(monkeypatch, launcher=SlowEngineLauncher()) as running:
        yield running


def replicas(client) -> list[dict]:
    return client.get("/v1/services/churn").json()["replicas"]


def steady(client) -> bool:
    """Two READY spot replicas, and nothing else alive."""
    alive = [r for r in replicas(client) if r["state"] not in ("TERMINATED", "PREEMPTED", "FAILED")]
    return len(alive) == 2 and all(r["market"] == "spot" and r["state"] == "READY" for r in alive)


def launches_since(client, seen: int) -> list[dict]:
    events = client.get("/v1/events", params={"service": "churn", "limit": 1000}).json()
    return [e for e in events if e["kind"] == "launch"][seen:]


def test_each_preemption_launches_one_replacement_and_at_most_one_cover(daemon):
    d, client = daemon
    client.post("/v1/services", json={"yaml": SPEC}).raise_for_status()
    wait_for(lambda: steady(client), 60, "2 READY spot replicas")
    seen = len(launches_since(client, 0))
    assert seen == 2  # the first round: one spot replica per zone, no cover

    for round_ in range(2):  # two preemptions, each after the service has settled again
        victim = next(r for r in replicas(client) if r["state"] == "READY")
        out = client.post("/v1/chaos/preempt", json={"replica_id": victim["replica_id"], "grace_s": GRACE_S})
        assert out.json()["preempted"] == [victim["replica_id"]]
        wait_for(lambda v=victim["replica_id"]: next(r for r in replicas(client) if r["replica_id"] == v)["state"]
                 == "PREEMPTED", 30, "the victim to die at its deadline")
        wait_for(lambda: steady(client), 60, "the service to settle on 2 READY spot replicas")
        new = launches_since(client, seen)
        seen += len(new)
        markets = sorted(e["market"] for e in new)
        # The replacement at the notice, and one on-demand cover while it starts: nothing at the
        # deadline, although the notice was shorter than the cold start.
        assert markets in (["spot"], ["on_demand", "spot"]), f"round {round_}: {new}"
