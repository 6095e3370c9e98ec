"""The daemon end to end with real processes, real HTTP and a real SQLite file, but a
stand-in engine (tests/fakes/engine.py) instead of vLLM so it runs in seconds.

What is real: the daemon's API server and jobs, the controller, the local cloud's
processes, the load balancer, the store. What is not: the engine inside each replica.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.control.launch import ReplicaLauncher
from providers.base import LaunchRequest, Market
from tests.helpers import FAKES, alive, running_daemon, wait_for

FAKE_ENGINE = FAKES / "engine.py"

SPEC = """
name: svc
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 60
  replicas: 2
resources:
  cloud: local
  use_spot: true
  any_of: [{zone: local-a}, {zone: local-b}]
engine:
  model: tiny
kv:
  enabled: false
"""


class FakeEngineLauncher(ReplicaLauncher):
    """Replicas that run the stand-in engine; `ready_after` seconds before its health answers."""

    def __init__(self, ready_after: float = 0.0):
        super().__init__()
        self.ready_after = ready_after

    def request(self, spec, row, offer, runtime) -> LaunchRequest:
        return LaunchRequest(
            service=spec.name, replica_id=row.replica_id, location=offer.location, market=offer.market,
            instance_type="",
            command=[sys.executable, str(FAKE_ENGINE), "--port", "{port}", "--name", spec.name,
                     "--ready-after", str(self.ready_after)],
        )


@pytest.fixture
def daemon(state_home, monkeypatch):
    with running_daemon(monkeypatch, launcher=FakeEngineLauncher()) as running:
        yield running


def ready(client, name="svc"):
    svc = client.get(f"/v1/services/{name}").json()
    return [r for r in svc["replicas"] if r["state"] == "READY"]


def pid_of(instance_id: str) -> int:
    """The replica's process group, from the local cloud's on-disk record (what `ps` shows)."""
    record = Path(os.environ["SPOT_ORCHESTRATOR_HOME"]) / "local-cloud" / "instances" / f"{instance_id}.json"
    return json.loads(record.read_text())["pgid"]


def test_api_requires_the_token(daemon):
    d, _ = daemon
    assert httpx.get(f"{d.url}/v1/health").status_code == 200
    assert httpx.get(f"{d.url}/v1/services").status_code == 401
    assert httpx.get(f"{d.url}/v1/services", headers={"Authorization": "Bearer wrong"}).status_code == 401
    token_file = Path(os.environ["SPOT_ORCHESTRATOR_HOME"]) / "token"
    assert token_file.stat().st_mode & 0o777 == 0o600


def test_bad_spec_is_one_line_and_nothing_is_stored(daemon):
    _, client = daemon
    r = client.post("/v1/services", json={"yaml": "name: x\nservice:\n  replicas: two\nengine:\n  model: tiny\n"})
    assert r.status_code == 400
    detail = r.json()["detail"]
    assert "service.replicas" in detail and "\n" not in detail
    assert client.get("/v1/services").json() == []
    r = client.post("/v1/services", json={"yaml": ""})
    assert r.status_code == 422 and "yaml" in r.json()["detail"]


def test_service_runs_replaces_a_dead_replica_and_goes_down_cleanly(daemon):
    d, client = daemon
    out = client.post("/v1/services", json={"yaml": SPEC}).json()
    wait_for(lambda: len(ready(client)) == 2, 60, "2 READY replicas")
    replicas = ready(client)
    assert {r["zone"] for r in replicas} == {"local-a", "local-b"}
    assert all(r["market"] == Market.SPOT.value for r in replicas)

    # The load balancer in front of them answers.
    lb = httpx.Client(base_url=out["endpoint"], timeout=10)
    r = lb.post("/v1/completions", json={"model": "svc", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("from ")

    # A replica dies on its own: it is marked and replaced, and requests keep succeeding.
    victim = replicas[0]
    os.killpg(pid_of(victim["instance_id"]), signal.SIGKILL)
    for _ in range(20):
        assert lb.post("/v1/completions", json={"model": "svc", "prompt": "hi", "max_tokens": 2}).status_code == 200
    wait_for(lambda: len(ready(client)) >= 2 and victim["replica_id"] not in {r["replica_id"] for r in ready(client)},
             60, "a replacement")
    states = {r["replica_id"]: r["state"] for r in client.get("/v1/services/svc").json()["replicas"]}
    assert states[victim["replica_id"]] == "PREEMPTED"
    kinds = [e["kind"] for e in client.get("/v1/events", params={"service": "svc"}).json()]
    assert "preempted" in kinds and "launch" in kinds

    # `down` terminates every process.
    pids = [pid_of(r["instance_id"]) for r in ready(client)]
    client.delete("/v1/services/svc")
    wait_for(lambda: client.get("/v1/services/svc").status_code == 404, 60, "the service to be deleted")
    for pid in pids:
        wait_for(lambda pid=pid: not alive(pid), 10, f"pid {pid} to exit")


def test_notice_drains_replaces_and_the_deadline_kills(daemon):
    d, client = daemon
    client.post("/v1/services", json={"yaml": SPEC})
    wait_for(lambda: len(ready(client)) == 2, 60, "2 READY replicas")
    victim = ready(client)[0]
    r = client.post("/v1/chaos/preempt", json={"replica_id": victim["replica_id"], "grace_s": 3})
    assert r.json()["preempted"] == [victim["replica_id"]]
    states = {x["replica_id"]: x["state"] for x in client.get("/v1/services/svc").json()["replicas"]}
    assert states[victim["replica_id"]] == "DRAINING"  # at once, not at the next tick
    # The replacement is launched on the notice, before the victim dies.
    wait_for(lambda: len(client.get("/v1/services/svc").json()["replicas"]) >= 3, 10, "a replacement launch")
    wait_for(
        lambda: {x["replica_id"]: x["state"] for x in client.get("/v1/services/svc").json()["replicas"]}[
            victim["replica_id"]] == "PREEMPTED",
        30, "the victim to be PREEMPTED after its deadline",
    )
    wait_for(lambda: len(ready(client)) >= 2, 60, "2 READY replicas again")
    # A notice from an agent for an unknown instance is accepted and ignored.
    r = client.post("/v1/notices", json={"instance_id": "nope", "kind": "preempt", "deadline": time.time() + 30})
    assert r.status_code == 200 and r.json()["replica_id"] is None
    r = client.post("/v1/notices", json={"instance_id": "x", "kind": "bogus", "deadline": 1})
    assert r.status_code == 422 and "kind" in r.json()["detail"]


def test_a_daemon_slow_to_answer_is_still_the_running_daemon(state_home):
    """A busy daemon (its pid alive, its port open, its answer late) is found, not replaced:
    `spotctl` must neither say "no daemon is running" nor start a second one."""
    import socket

    from orchestrator.control import discovery
    from orchestrator.control.discovery import write_daemon_info

    with socket.socket() as silent:  # accepts (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        write_daemon_info(url)  # this process's pid: alive
        assert discovery.running_daemon_url() == url
    write_daemon_info(url)  # the port now refuses: no daemon there
    assert discovery.running_daemon_url() is None


def test_a_slow_pass_is_logged_once_with_its_time(caplog, monkeypatch):
    import logging

    from orchestrator.control import daemon
    monkeypatch.setattr(daemon, "SLOW_PASS_S", 0.05)
    with caplog.at_level(logging.INFO):
        daemon._timed("reconcile of svc", lambda: time.sleep(0.1))
        daemon._timed("probe of svc", lambda: None)
        for _ in range(3):  # what apscheduler says at every interval the pass overran
            logging.getLogger("apscheduler.scheduler").warning(
                'Execution of job "%s" skipped: maximum number of running instances reached (%d)', "reconcile", 1)
    assert [r.getMessage().split(" took")[0] for r in caplog.records] == ["reconcile of svc"]
