"""Updates of a running service through the real daemon: `spotctl up` / `spotctl update` of a
changed spec replaces the replicas, rolling or blue-green, and a count change replaces none.

Real: the daemon's API and jobs, the local cloud's processes, the load balancer, the store, the
CLI, the openai client. The engine is tests/fakes/upstream.py (greedy tokens are a function of
the token sequence, so a stream moved off a replaced replica must match an uninterrupted run).
A watcher reads the daemon's API throughout, as `spotctl status` would.
"""

from __future__ import annotations

import json
import sys
import threading

import httpx
import pytest

from orchestrator.control.launch import ReplicaLauncher
from providers.base import LaunchRequest
from tests.fakes.migration_harness import Chats, check_streams, events, service, status, wait_ready
from tests.helpers import FAKES, running_daemon, spotctl, wait_for

FAKE = FAKES / "upstream.py"
SPEC = """
name: upd
service:
  readiness_probe: {path: /health, initial_delay_seconds: 60}
  replicas: 2
  placement_policy: even_spread
resources:
  cloud: local
  use_spot: true
  any_of: [{zone: local-a}, {zone: local-b}, {zone: local-c}]
engine:
  model: tiny
  args: ["--seed", "0"]
kv:
  enabled: false
"""
CHANGED = SPEC.replace('"--seed", "0"', '"--seed", "1"')  # new engine arguments: every replica replaced
STREAMS, MAX_TOKENS, CUT_AT = 6, 250, 10
GONE = {"DRAINING", "SHUTTING_DOWN", "TERMINATED", "PREEMPTED"}


class RecordingLauncher(ReplicaLauncher):
    """The fake upstream, and the engine arguments each replica was launched with."""

    def __init__(self):
        super().__init__()
        self.args: dict[str, tuple[str, ...]] = {}

    def request(self, spec, row, offer, runtime) -> LaunchRequest:
        self.args[row.replica_id] = spec.engine.args
        return LaunchRequest(
            service=spec.name, replica_id=row.replica_id, location=offer.location, market=offer.market,
            instance_type="",
            command=[sys.executable, str(FAKE), "--port", "{port}", "--name", row.replica_id,
                     "--token-delay", "0.03"],
        )


class Watcher:
    """Reads GET /v1/services/upd in a thread until stopped: every snapshot, in order."""

    def __init__(self, url: str, token: str):
        self.snapshots: list[dict] = []
        self._stop = threading.Event()
        self._client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.snapshots.append(self._client.get("/v1/services/upd").json())
            self._stop.wait(0.05)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(30)
        self._client.close()
        return self.snapshots


@pytest.fixture
def daemon(state_home, monkeypatch):
    launcher = RecordingLauncher()
    with running_daemon(monkeypatch, launcher=launcher) as (d, client):
        client.post("/v1/services", json={"yaml": SPEC}).raise_for_status()
        wait_ready(client, "upd", 2, 120)
        yield d, client, launcher


def _write(tmp_path, text: str):
    path = tmp_path / "upd.yaml"
    path.write_text(text)
    return path


def _finished(client) -> dict | None:
    svc = service(client, "upd")
    return svc if not svc["update"]["in_progress"] and len([r for r in svc["replicas"]
                                                              if r["state"] == "READY"]) >= 2 else None


def test_a_rolling_update_replaces_every_replica_and_moves_their_streams(daemon, tmp_path):
    d, client, launcher = daemon
    old = {r["replica_id"] for r in service(client, "upd")["replicas"]}
    lb_url = service(client, "upd")["endpoint"]
    reference = Chats(lb_url, "upd", STREAMS, MAX_TOKENS).join()
    assert not [s.error for s in reference if s.error]
    chats = Chats(lb_url, "upd", STREAMS, MAX_TOKENS)
    chats.wait_tokens(CUT_AT)
    watcher = Watcher(d.url, d.token)
    out = json.loads(spotctl("up", str(_write(tmp_path, CHANGED)), "--json", timeout=120).stdout)
    assert out["update"]["mode"] == "rolling" and out["update"]["replacing"] == 2

    check_streams(chats.join(), reference)  # the streams on the replaced replicas went on, whole
    wait_for(lambda: _finished(client), 180, "the update to finish", 0.5)
    snapshots = watcher.stop()

    assert min(s["replicas_ready"] for s in snapshots) >= 2  # never below the spec's count
    progress = {(s["update"]["old"], s["update"]["new"]) for s in snapshots if s["update"]["in_progress"]}
    assert (2, 1) in progress or (2, 0) in progress  # status showed the update under way
    final = status("upd")
    live = [r for r in final["replicas"] if r["state"] not in GONE]
    assert {r["replica_id"] for r in live}.isdisjoint(old)
    assert all(launcher.args[r["replica_id"]] == ("--seed", "1") for r in live)  # the new arguments reached them
    assert {r["spec_revision"] for r in live} == {final["update"]["revision"]}
    wait_for(lambda: {r["replica_id"]: r["state"] for r in service(client, "upd")["replicas"]
                      if r["replica_id"] in old} == dict.fromkeys(old, "TERMINATED"),
             60, "the old replicas to be terminated", 0.5)

    kinds = [e["kind"] for e in events("upd")]
    assert kinds.count("update_started") == 1 and kinds.count("update_finished") == 1
    replaced = [e for e in events("upd") if e["kind"] == "replica_replaced"]
    assert {e["replica_id"] for e in replaced} == old
    moved = [e for e in events("upd") if e["kind"] == "migration" and e["replica_id"] in old]
    assert moved and any(not e["message"].startswith("0/") for e in moved)  # streams were in flight on them
    assert "notice" not in {e["kind"] for e in events("upd") if e["replica_id"] in old}  # not a market event


def test_blue_green_starts_the_new_set_before_draining_the_old(daemon, tmp_path):
    d, client, launcher = daemon
    old = {r["replica_id"] for r in service(client, "upd")["replicas"]}
    watcher = Watcher(d.url, d.token)
    out = json.loads(spotctl("update", str(_write(tmp_path, CHANGED)), "--mode", "blue-green", "--wait", "--json",
                             timeout=300).stdout)
    assert out["update"]["mode"] == "blue-green"
    snapshots = watcher.stop()
    assert not service(client, "upd")["update"]["in_progress"]  # --wait returned once it finished

    assert min(s["replicas_ready"] for s in snapshots) >= 2
    first_gone = next(s for s in snapshots if any(r["replica_id"] in old and r["state"] in GONE
                                                  for r in s["replicas"]))
    new_ready = [r for r in first_gone["replicas"] if r["replica_id"] not in old and r["state"] == "READY"]
    assert len(new_ready) >= 2  # the whole new set was READY before any old one left
    assert sum(1 for s in snapshots for r in s["replicas"] if r["replica_id"] not in old) > 0
    new = {r["replica_id"] for r in service(client, "upd")["replicas"] if r["state"] == "READY"}
    assert new.isdisjoint(old) and all(launcher.args[rid] == ("--seed", "1") for rid in new)


def test_a_count_or_lb_policy_change_replaces_nothing(daemon, tmp_path):
    d, client, _ = daemon
    before = {r["replica_id"] for r in service(client, "upd")["replicas"]}
    text = SPEC.replace("replicas: 2", "replicas: 3\n  load_balancing_policy: round_robin")
    out = json.loads(spotctl("update", str(_write(tmp_path, text)), "--json", timeout=120).stdout)
    assert out["update"]["replacing"] == 0
    svc = wait_ready(client, "upd", 3, 120)
    assert before <= {r["replica_id"] for r in svc["replicas"] if r["state"] == "READY"}
    assert not svc["update"]["in_progress"] and svc["update"]["old"] == 0
    assert d.lbs["upd"].policy == "round_robin"  # applied to the running load balancer
    kinds = {e["kind"] for e in events("upd")}
    assert not kinds & {"update_started", "replica_replaced"}


def test_update_of_an_unknown_service_or_a_bad_mode_is_one_line_and_exit_2(daemon, tmp_path):
    spec = _write(tmp_path, SPEC.replace("name: upd", "name: ghost"))
    for args, says in [((str(spec),), "no service named 'ghost'"),
                       ((str(spec), "--mode", "sideways"), "sideways")]:
        proc = spotctl("update", *args, check=False, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr
        assert "Traceback" not in proc.stderr
    assert "update" in spotctl("--help", timeout=60).stdout
