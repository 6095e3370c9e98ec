"""What a crash or a lost state leaves behind, and how the daemon deals with it: a service
down then up again (its new replicas reuse the old ids), a daemon killed between a launch and
its record, machines of an unknown service or incarnation, a lost state database, and one
daemon per state directory. Real daemon, real local-cloud processes (the stand-in engine),
real SQLite, real spotctl where the user's path goes through it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.control.store import Store
from providers.base import (
    TAG_INCARNATION,
    TAG_SERVICE,
    InstanceStatus,
    LaunchRequest,
    Location,
    Market,
)
from providers.local import LocalProvider
from tests.fakes.standin import SPEC, UPSTREAM, StandInLauncher
from tests.helpers import alive, running_daemon, spotctl, wait_for

LAUNCHER = {"SPOT_ORCHESTRATOR_LAUNCHER": "tests.fakes.standin:StandInLauncher", "PYTHONPATH": os.getcwd()}


def replicas(client, name="svc"):
    return client.get(f"/v1/services/{name}").json()["replicas"]


def ready(client, name="svc"):
    return [r for r in replicas(client, name) if r["state"] == "READY"]


def live_instances(name: str | None = None):
    return [i for i in LocalProvider().list({TAG_SERVICE: name} if name else None)
            if i.status is not InstanceStatus.TERMINATED]


def stray_request(service: str, replica_id: str, incarnation: str) -> LaunchRequest:
    """What a daemon killed mid-launch had sent: a machine tagged as its replica."""
    return LaunchRequest(service=service, replica_id=replica_id, location=Location("local", "local", "local-a"),
                         market=Market.SPOT, instance_type="", incarnation=incarnation,
                         command=[sys.executable, str(UPSTREAM), "--port", "{port}", "--name", service])


def test_down_then_up_gets_new_machines_not_the_old_terminated_ones(state_home, monkeypatch):
    with running_daemon(monkeypatch, launcher=StandInLauncher()) as (_, client):
        client.post("/v1/services", json={"yaml": SPEC.format(name="svc")})
        first = wait_for(lambda: ready(client), 60, "a READY replica")[0]
        client.delete("/v1/services/svc")
        wait_for(lambda: client.get("/v1/services/svc").status_code == 404, 60, "the service to go")

        client.post("/v1/services", json={"yaml": SPEC.format(name="svc")})
        wait_for(lambda: first["replica_id"] in {r["replica_id"] for r in ready(client)}, 60,
                 "the new incarnation's replica 1 READY")
        second = next(r for r in ready(client) if r["replica_id"] == first["replica_id"])  # ids start at 1 again
        assert second["instance_id"] != first["instance_id"]  # ... but the machine is a new one
        states = {r["state"] for r in replicas(client)}
        assert "PREEMPTED" not in states and "FAILED_PROVISION" not in states
        incarnation = Store().get_service("svc").incarnation
        live = live_instances("svc")
        assert {i.tags[TAG_INCARNATION] for i in live} == {incarnation}
        assert {i.instance_id for i in live} <= {r["instance_id"] for r in replicas(client)}


def test_a_launch_never_recorded_is_adopted_and_a_taken_slot_is_freed(state_home, monkeypatch):
    with running_daemon(monkeypatch, launcher=StandInLauncher(), keep_services=True) as (_, client):
        client.post("/v1/services", json={"yaml": SPEC.format(name="svc")})
        wait_for(lambda: ready(client), 60, "a READY replica")
    # What a daemon killed in the middle of launches leaves: a replica PROVISIONING whose
    # machine runs (launched, not recorded), one PROVISIONING whose launch never happened,
    # and a machine of this incarnation whose replica is already served by another.
    store = Store()
    incarnation = store.get_service("svc").incarnation
    launched = store.add_replica("svc", cloud="local", region="local", zone="local-a", market="spot")
    launched = store.update_replica(launched.replica_id, launched.version, state="PROVISIONING")
    never = store.add_replica("svc", cloud="local", region="local", zone="local-b", market="spot")
    store.update_replica(never.replica_id, never.version, state="PROVISIONING")
    cloud = LocalProvider()
    machine = cloud.launch(stray_request("svc", launched.replica_id, incarnation))
    first = store.list_replicas("svc")[0]
    duplicate = cloud.launch(_Retry(**vars(stray_request("svc", first.replica_id, incarnation))))
    cloud.close()

    with running_daemon(monkeypatch, launcher=StandInLauncher()) as (_, client):
        def settled():
            rows = {r["replica_id"]: r for r in replicas(client)}
            return (rows[launched.replica_id]["instance_id"] == machine.instance_id
                    and rows[never.replica_id]["state"] == "FAILED_PROVISION"
                    and duplicate.instance_id not in {i.instance_id for i in live_instances("svc")})
        wait_for(settled, 60, "the adoption, the failed launch and the duplicate's end")
        events = client.get("/v1/events", params={"service": "svc"}).json()
        assert any(e["kind"] == "orphan_terminated" and duplicate.instance_id in e["message"] for e in events)
        # Nothing is left PROVISIONING, and every live machine is a recorded replica's.
        wait_for(lambda: all(r["state"] not in ("PENDING", "PROVISIONING") for r in replicas(client)), 30,
                 "no transient replica")
        recorded = {r["instance_id"] for r in replicas(client) if r["state"] in ("STARTING", "READY", "SHUTTING_DOWN")}
        wait_for(lambda: {i.instance_id for i in live_instances("svc")} <= recorded, 30, "no unowned machine")


class _Retry(LaunchRequest):
    """Another launch of the same replica with a token of its own (e.g. an expired one)."""

    @property
    def client_token(self) -> str:
        return self.launch_key + "-retry"


def test_machines_of_an_unknown_service_or_incarnation_are_reported_then_terminated(state_home, monkeypatch):
    monkeypatch.setenv("SPOT_ORCHESTRATOR_ORPHAN_GRACE_S", "2")
    monkeypatch.setattr("orchestrator.control.daemon.ORPHANS_INTERVAL_S", 0.5)
    with running_daemon(monkeypatch, launcher=StandInLauncher()) as (d, client):
        client.post("/v1/services", json={"yaml": SPEC.format(name="svc")})
        wait_for(lambda: ready(client), 60, "a READY replica")
        cloud = LocalProvider()
        ghost = cloud.launch(stray_request("ghost", "ghost-1", "abcd"))
        stale = cloud.launch(stray_request("svc", "svc-1", "old-incarnation"))
        cloud.close()
        seen = wait_for(lambda: {o["instance_id"] for o in client.get("/v1/orphans").json()} >=
                        {ghost.instance_id, stale.instance_id}, 30, "both orphans reported")
        assert seen
        kinds = [(e["kind"], e["message"]) for e in client.get("/v1/events").json()]
        assert any(k == "orphan" and ghost.instance_id in m for k, m in kinds)
        wait_for(lambda: not {ghost.instance_id, stale.instance_id} & {i.instance_id for i in live_instances()},
                 30, "the orphans terminated after their grace")
        assert len(ready(client)) == 1  # the service's own replica is untouched


def test_down_all_terminates_orphans_at_once(state_home, monkeypatch):
    monkeypatch.setenv("SPOT_ORCHESTRATOR_ORPHAN_GRACE_S", "3600")
    with running_daemon(monkeypatch, launcher=StandInLauncher()) as (d, client):
        from orchestrator.control import orphans

        orphans.remember_clouds(["local"])
        cloud = LocalProvider()
        ghost = cloud.launch(stray_request("ghost", "ghost-1", "abcd"))
        cloud.close()
        env = {"SPOT_ORCHESTRATOR_HOME": str(state_home)}
        out = spotctl("down", "--all", "-y", env=env, timeout=120)
        assert "no orphan machines" in out.stdout or "orphan" in out.stdout
        assert ghost.instance_id not in {i.instance_id for i in live_instances()}


def _write_discovery_free_env(state_home: Path) -> dict:
    return {"SPOT_ORCHESTRATOR_HOME": str(state_home), **LAUNCHER}


def test_a_lost_state_database_is_an_error_with_the_way_out(state_home, monkeypatch):
    env = _write_discovery_free_env(state_home)
    spotctl("up", str(_spec_file(state_home)), "--wait", "--timeout", "120", env=env, timeout=180)
    machines = live_instances("svc")
    assert machines
    _kill_daemon(state_home)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{state_home}/state.db{suffix}").unlink(missing_ok=True)

    out = spotctl("status", check=False, env=env, timeout=120)
    assert out.returncode == 1, out
    line = out.stderr.strip()
    assert "\n" not in line and "state database" in line and "spotctl down --all --orphans" in line
    assert "Traceback" not in out.stderr

    out = spotctl("down", "--all", "--orphans", "-y", env=env, timeout=120)
    assert "terminated" in out.stdout
    assert not live_instances()
    for m in machines:
        wait_for(lambda m=m: not _pid_alive_of(state_home, m.instance_id), 15, "the machine's process to exit")
    out = spotctl("status", env=env, timeout=120)  # a fresh start is fine now: nothing runs
    assert "no services" in out.stdout
    _kill_daemon(state_home)


def test_an_unreadable_state_database_is_an_error(state_home):
    (state_home / "state.db").write_bytes(b"this is not a database" * 200)
    out = spotctl("daemon", "--port", "0", check=False, timeout=60, env={"SPOT_ORCHESTRATOR_HOME": str(state_home)})
    assert out.returncode == 1
    assert "cannot be read" in out.stderr and "spotctl down --all --orphans" in out.stderr
    assert "Traceback" not in out.stderr


def test_one_daemon_per_state_directory_whatever_the_port(state_home):
    env = {**os.environ, "SPOT_ORCHESTRATOR_HOME": str(state_home)}
    cmd = [sys.executable, "-m", "orchestrator.control.daemon", "--port", "0"]
    logs = [state_home / f"daemon{i}.err" for i in range(2)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w")) for log in logs]
    try:
        loser = wait_for(lambda: next((p for p in procs if p.poll() is not None), None), 60, "one daemon to refuse")
        assert loser.returncode == 2
        assert "already runs for the state in" in logs[procs.index(loser)].read_text()
        winner = next(p for p in procs if p is not loser)
        assert winner.poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)


def test_any_verb_starts_the_daemon_and_a_killed_one_comes_back(state_home):
    env = {"SPOT_ORCHESTRATOR_HOME": str(state_home), **LAUNCHER}
    out = spotctl("status", env=env, timeout=120)
    assert "no services" in out.stdout
    pid = _daemon_pid(state_home)
    os.kill(pid, 9)
    wait_for(lambda: not alive(pid), 10, "the daemon to die")
    out = spotctl("events", env=env, timeout=120)
    assert _daemon_pid(state_home) != pid
    _kill_daemon(state_home)


# ---- helpers ------------------------------------------------------------------------------


def _spec_file(home: Path) -> Path:
    path = home / "svc.yaml"
    path.write_text(SPEC.format(name="svc"))
    return path


def _daemon_pid(home: Path) -> int:
    import json

    return json.loads((home / "daemon.json").read_text())["pid"]


def _kill_daemon(home: Path) -> None:
    try:
        pid = _daemon_pid(home)
    except FileNotFoundError:
        return
    if alive(pid):
        os.kill(pid, 9)
        wait_for(lambda: not alive(pid), 10, "the daemon to die")
    time.sleep(0.1)


def _pid_alive_of(home: Path, instance_id: str) -> bool:
    import json

    record = home / "local-cloud" / "instances" / f"{instance_id}.json"
    return alive(json.loads(record.read_text())["pgid"])

