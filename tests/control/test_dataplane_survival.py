"""The data plane outlives the daemon: a real daemon process (started by spotctl, as a user's),
its data-plane process, local-cloud replicas running the fake vLLM, real SQLite. The daemon is
SIGKILLed in the middle of a stream; the stream ends whole, the endpoint keeps serving, a
notice the replica's agent sends meanwhile is retried until the restarted daemon acts on it,
and the restarted daemon adopts the data plane and the replicas without launching anything."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from orchestrator.control import auth
from orchestrator.control.store import Store
from orchestrator.replica.watchers import NoticeReporter, WatchLoop
from tests.fakes.lb_client import Reader, events, ids_of
from tests.fakes.standin import SPEC
from tests.helpers import REPO, alive, spotctl, wait_for

pytestmark = pytest.mark.timeout(300)
ENV = {"SPOT_ORCHESTRATOR_LAUNCHER": "tests.fakes.standin:StandInLauncher", "PYTHONPATH": str(REPO),
       "SPOT_ORCHESTRATOR_RECONCILE_S": "0.5", "SPOT_ORCHESTRATOR_PROBE_S": "0.5"}
BODY = {"model": "svc", "prompt": "hello there", "max_tokens": 50, "stream": True, "return_token_ids": True,
        "fake_token_delay": 0.08}
RECONCILE_S = 0.5


class OneNotice:
    """A cloud's notice watcher (as providers/watch/ has one per cloud) that sees one notice."""

    interval = 0.2
    source = "test"

    def __init__(self, instance_id: str):
        self.notice = {"instance_id": instance_id, "kind": "preempt", "deadline": time.time() + 600,
                       "source": "test"}

    def poll(self, _client) -> list[tuple[str, dict]]:
        return [("n1", self.notice)]


def pid_of(home, record: str) -> int:
    return int(json.loads((home / record).read_text())["pid"])


def operator(home) -> httpx.Client:
    url = json.loads((home / "daemon.json").read_text())["url"]
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {auth.read_token()}"}, timeout=60)


def launches() -> int:
    return len(Store().list_events(service="svc", kinds=["launch"]))


def kill_daemon(home) -> int:
    pid = pid_of(home, "daemon.json")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 10, "the daemon to die")
    return pid


def test_streams_outlive_a_killed_daemon_and_the_next_one_adopts_everything(state_home, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    spec = state_home / "svc.yaml"
    spec.write_text(SPEC.format(name="svc"))
    spotctl("up", str(spec), "--wait", "--timeout", "120", timeout=180)
    with operator(state_home) as client:
        svc = client.get("/v1/services/svc").json()
    endpoint, replica = svc["endpoint"], next(r for r in svc["replicas"] if r["state"] == "READY")
    reference = ids_of(events(endpoint, "/v1/completions", {**BODY, "fake_token_delay": 0}))
    assert len(reference) == BODY["max_tokens"]
    plane, launched = pid_of(state_home, "dataplane.json"), launches()

    # SIGKILL in the middle of a stream: the stream goes on to its last token.
    reader = Reader(endpoint, "/v1/completions", BODY)
    wait_for(lambda: len(reader.chunks) >= 10, 30, "the stream under way")
    killed = kill_daemon(state_home)
    reader.join(60)
    assert reader.done and reader.error is None, reader
    assert ids_of(reader.chunks) == reference
    assert alive(plane)

    # With no daemon: the endpoint serves new requests; the agent's notice is not delivered yet.
    assert ids_of(events(endpoint, "/v1/completions", {**BODY, "fake_token_delay": 0})) == reference
    token = auth.replica_token_for(Store().get_replica(replica["replica_id"]))
    daemon_url = f"http://127.0.0.1:{os.environ['SPOT_ORCHESTRATOR_DAEMON_PORT']}"
    agent = WatchLoop(OneNotice(replica["instance_id"]), NoticeReporter(daemon_url, token))
    assert agent.step() == []

    # The next verb starts a daemon; a stream in flight across its start does not notice.
    crossing = Reader(endpoint, "/v1/completions", BODY)
    wait_for(lambda: len(crossing.chunks) >= 5, 30, "a stream under way")
    spotctl("status", timeout=120)
    assert pid_of(state_home, "daemon.json") != killed
    crossing.join(60)
    assert crossing.done and ids_of(crossing.chunks) == reference, crossing
    assert pid_of(state_home, "dataplane.json") == plane  # adopted, not restarted

    # Its reconciles find the replica running: nothing is launched, the same machine serves.
    time.sleep(8 * RECONCILE_S)
    assert launches() == launched
    with operator(state_home) as client:
        rows = client.get("/v1/services/svc").json()["replicas"]
    assert [(r["replica_id"], r["instance_id"], r["state"]) for r in rows] == \
        [(replica["replica_id"], replica["instance_id"], "READY")]
    assert ids_of(events(endpoint, "/v1/completions", {**BODY, "fake_token_delay": 0})) == reference

    # The agent's next poll reaches the daemon, which acts on the notice.
    wait_for(agent.step, 30, "the notice delivered")
    with operator(state_home) as client:
        wait_for(lambda: any(r["replica_id"] == replica["replica_id"] and r["state"] == "DRAINING"
                             for r in client.get("/v1/services/svc").json()["replicas"]), 30, "the replica DRAINING")
    wait_for(lambda: launches() > launched, 30, "its replacement launched")
    agent.close()

    # The last service down: the data plane, hosting nothing, exits.
    spotctl("down", "svc", "-y", timeout=120)
    wait_for(lambda: not alive(plane), 30, "the data plane to exit")
    assert not (state_home / "dataplane.json").exists()
