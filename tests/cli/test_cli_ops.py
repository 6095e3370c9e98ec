"""spotctl's operating conventions through the real CLI against a real daemon (stand-in engine):
exit codes (2 input, 1 runtime), `down` confirmation, `--json` on down and logs, `up --wait`
progress and its failure on a FAILED service, `logs --daemon` / `--lb`, the log level."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.control.launch import ReplicaLauncher
from providers.base import LaunchRequest
from tests.control.test_daemon import SPEC, FakeEngineLauncher, ready
from tests.helpers import REPO, alive, running_daemon, spotctl, wait_for


@pytest.fixture
def daemon(state_home, monkeypatch):
    with running_daemon(monkeypatch, launcher=FakeEngineLauncher()) as running:
        yield running


def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return lines[0]


def test_a_verb_starts_the_daemon_once_and_input_errors_exit_2(state_home, tmp_path):
    from orchestrator.control.discovery import read_daemon_info

    # No daemon: the verb starts one in the background and answers; the next verb reuses it.
    # (A daemon that cannot start is the runtime failure, exit 1: tests/cli/test_cli.py.)
    proc = spotctl("status", timeout=120)
    assert "no services" in proc.stdout
    first = read_daemon_info()
    assert first and alive(int(first["pid"]))
    spotctl("status", timeout=120)
    assert read_daemon_info()["pid"] == first["pid"]
    proc = spotctl("--log-level", "loud", "status", check=False, timeout=120)
    assert proc.returncode == 2 and "--log-level" in one_line(proc)
    proc = spotctl("logs", check=False, timeout=120)
    assert proc.returncode == 2 and "name a service" in one_line(proc)


@pytest.fixture
def slow_daemon(state_home, monkeypatch):
    """Replicas that take 3 s to become healthy, so `up --wait` sees them on their way."""
    with running_daemon(monkeypatch, launcher=FakeEngineLauncher(ready_after=3.0)) as running:
        yield running


def test_up_wait_shows_replica_progress_and_down_asks_first(slow_daemon, tmp_path):
    _, client = slow_daemon
    spec = tmp_path / "svc.yaml"
    spec.write_text(SPEC)
    proc = spotctl("up", str(spec), "--wait", "--timeout", "120", timeout=180, env={"COLUMNS": "200"})
    # A pipe gets one line per replica state change: replica, zone, market, state, elapsed.
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("svc-")]
    assert any(len(row) == 5 and row[1].startswith("local/local-") and row[2] == "spot" and row[3] == "READY"
               and row[4].endswith("s") for row in rows), proc.stdout
    assert any(row[3] in ("PENDING", "PROVISIONING", "STARTING") for row in rows), proc.stdout

    # No terminal and no -y: refused in one line, nothing torn down.
    proc = spotctl("down", "svc", check=False, timeout=120)
    assert proc.returncode == 2 and "-y" in one_line(proc)
    # A terminal that answers no: nothing torn down either (exit 1).
    master, slave = os.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "down", "svc"], stdin=slave,
                              input=None, capture_output=True, text=True, timeout=120, cwd=REPO,
                              env=os.environ.copy(), preexec_fn=lambda: os.write(master, b"n\n"))
    finally:
        os.close(slave)
        os.close(master)
    assert proc.returncode == 1 and "Tear down svc" in proc.stdout and "not confirmed" in proc.stderr
    assert client.get("/v1/services/svc").status_code == 200 and ready(client)

    out = json.loads(spotctl("logs", "svc", "svc-1", "--json", timeout=120).stdout.splitlines()[-1])
    assert out["source"] == "svc-1" and isinstance(out["line"], str)
    assert json.loads(spotctl("down", "svc", "-y", "--json", "--timeout", "60", timeout=120).stdout) == [
        {"name": "svc", "status": "down"}]
    assert client.get("/v1/services/svc").status_code == 404


class CrashingLauncher(ReplicaLauncher):
    """An engine that exits at once: a spec whose replicas can never start."""

    def request(self, spec, row, offer, runtime) -> LaunchRequest:
        return LaunchRequest(service=spec.name, replica_id=row.replica_id, location=offer.location,
                             market=offer.market, instance_type="",
                             command=[sys.executable, "-c", "import sys; sys.exit(3)"])


def test_up_wait_fails_at_once_when_the_service_fails(state_home, monkeypatch, tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(SPEC.replace("use_spot: true", "use_spot: false"))
    with running_daemon(monkeypatch, launcher=CrashingLauncher()) as (_, client):
        proc = spotctl("up", str(spec), "--wait", "--timeout", "600", check=False, timeout=300)
        assert proc.returncode == 1 and "FAILED" in one_line(proc), proc.stderr
        svc = client.get("/v1/services/svc").json()
        assert svc["status"] == "FAILED" and svc["replicas_ready"] == 0
        launched = len(svc["replicas"])
        wait_for(lambda: client.get("/v1/services/svc").json()["status"] == "FAILED", 5, "still FAILED")
        assert len(client.get("/v1/services/svc").json()["replicas"]) == launched  # no more launches


def test_logs_of_the_daemon_and_the_load_balancer_at_the_log_level_asked(state_home, tmp_path):
    env = {"SPOT_ORCHESTRATOR_DAEMON_PORT": "0"}
    daemon = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--log-level", "debug", "daemon",
                               "--port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, **env})
    try:
        wait_for(lambda: (state_home / "daemon.json").exists(), 60, "the daemon to listen")
        spec = tmp_path / "idle.yaml"
        spec.write_text("name: idle\nservice: {replicas: 0}\nresources: {cloud: local}\nengine: {model: tiny}\n")
        spotctl("up", str(spec), timeout=120)
        lines = [json.loads(line) for line in spotctl("logs", "--daemon", "--json", timeout=120).stdout.splitlines()]
        assert all(entry["source"] == "daemon" for entry in lines)
        text = "\n".join(entry["line"] for entry in lines)
        assert "daemon listening on" in text and " DEBUG " in text  # --log-level debug reached the daemon
        wait_for(lambda: "load balancer listening on" in spotctl("logs", "--lb", "idle", timeout=120).stdout, 30,
                 "the LB's log line")
        assert "daemon listening on" not in spotctl("logs", "--lb", timeout=120).stdout
        spotctl("down", "idle", "-y", timeout=120)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
