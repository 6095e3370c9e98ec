"""Two daemons on one PostgreSQL database: one leads, the other waits as a standby and takes over
when the leader dies, adopting its machines (no duplicate launch). The daemons are real
processes with a state directory each (two hosts), sharing the database and moto's EC2."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.control.leader import Leadership
from orchestrator.control.store import Store
from providers.aws import AWSProvider
from tests.fakes.postgres import fresh_db
from tests.helpers import REPO, alive, free_port, live_instances, moto_session, spotctl, wait_for

REGION = "us-east-1"
POLL_S = 0.5
SPEC = """
name: shared
service:
  readiness_probe: {{path: /health, initial_delay_seconds: 1200}}
  replicas: 2
resources:
  cloud: aws
  region: {region}
  accelerators: L4:1
  instance_type: g6.xlarge
  use_spot: true
  image_id: {image}
  any_of: [{{zone: us-east-1a}}, {{zone: us-east-1b}}]
engine: {{model: meta-llama/Llama-3.1-8B-Instruct}}
kv: {{enabled: false}}
"""


# ---- the lock itself ------------------------------------------------------------------------


def acquired_and_closed(url: str) -> bool:
    leadership = Leadership(url)
    try:
        return leadership.try_acquire()
    finally:
        leadership.close()


def test_sqlite_leadership_is_held_at_once(tmp_path):
    leadership = Leadership(f"sqlite:///{tmp_path / 'state.db'}")
    leadership.wait(poll=60, on_wait=lambda: pytest.fail("a SQLite daemon never waits"))
    assert leadership.held()
    leadership.close()


def test_one_leader_per_postgres_database_until_its_connection_closes(postgres_server):
    url = fresh_db(postgres_server)
    first, second = Leadership(url), Leadership(url)
    try:
        assert first.try_acquire() and first.held()
        assert not second.try_acquire() and not second.held()
        Store(url).close()  # a schema upgrade takes its own lock: it does not wait on the leader's
        waited = threading.Event()
        waiter = threading.Thread(target=second.wait, kwargs={"poll": 0.1, "on_wait": waited.set})
        waiter.start()
        wait_for(waited.is_set, 10, "the second to wait")
        time.sleep(0.5)
        assert not second.held()
        first.close()
        waiter.join(timeout=10)
        assert second.held()
        assert acquired_and_closed(fresh_db(postgres_server))  # another database: another lock
    finally:
        first.close()
        second.close()


def test_a_dropped_leader_connection_is_reported(postgres_server, monkeypatch):
    import psycopg

    monkeypatch.setenv("SPOT_ORCHESTRATOR_LEADER_POLL_S", "0.1")
    url = fresh_db(postgres_server)
    lost: list[str] = []
    leadership = Leadership(url, on_lost=lost.append)
    try:
        assert leadership.try_acquire()
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                          "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")
        wait_for(lambda: lost, 10, "the watchdog to notice")
        assert not leadership.held()
        assert acquired_and_closed(url)  # the lock went with the session: another may lead
    finally:
        leadership.close()


# ---- two daemon processes ------------------------------------------------------------------


class DaemonProcess:
    """`python -m orchestrator.control.daemon` with a state directory of its own."""

    def __init__(self, home: Path, env: dict[str, str]):
        self.home, self.port = home, free_port()
        home.mkdir()
        self.env = {**os.environ, **env, "SPOT_ORCHESTRATOR_HOME": str(home),
                    "SPOT_ORCHESTRATOR_DAEMON_PORT": str(self.port), "PYTHONPATH": str(REPO)}
        self.log = home / "stderr.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.control.daemon", "--port",
                                          str(self.port)], env=self.env, cwd=REPO, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def health(self) -> dict | None:
        try:
            return httpx.get(f"{self.url}/v1/health", timeout=5).json()
        except httpx.HTTPError:
            return None

    def role(self) -> str | None:
        assert self.proc.poll() is None, f"the daemon exited:\n{self.log.read_text()[-3000:]}"
        return (self.health() or {}).get("role")

    def client(self) -> httpx.Client:
        token = (self.home / "token").read_text().strip()
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=300)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """The host dies: its daemon and the data plane beside it (which holds the ports the
        other host's load balancers take over, on this one machine)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        with contextlib.suppress(OSError, ValueError, ProcessLookupError):
            os.kill(int(json.loads((self.home / "dataplane.json").read_text())["pid"]), signal.SIGKILL)


@pytest.fixture
def two_hosts(tmp_path, postgres_server, moto_url):
    """Daemon A started (and leading), then daemon B, on one PostgreSQL database and one moto."""
    env = {"SPOT_ORCHESTRATOR_DB_URL": fresh_db(postgres_server), "AWS_ENDPOINT_URL": moto_url,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION,
           "AWS_EC2_METADATA_DISABLED": "true", "SPOT_ORCHESTRATOR_RECONCILE_S": str(POLL_S),
           "SPOT_ORCHESTRATOR_LEADER_POLL_S": str(POLL_S),
           # The URL its VMs would reach it at (moto boots none; the boot scripts only name it).
           "SPOT_ORCHESTRATOR_PUBLIC_URL": "http://127.0.0.1:9"}
    started: list[DaemonProcess] = []
    try:
        a = DaemonProcess(tmp_path / "host-a", env)
        started.append(a)
        wait_for(lambda: a.role() == "leader", 120, "daemon A to lead", 0.5)
        b = DaemonProcess(tmp_path / "host-b", env)
        started.append(b)
        yield a, b
    finally:
        for daemon in started:
            daemon.kill()


def test_standby_takes_over_and_adopts_the_leaders_machines(two_hosts, moto_url, moto_image):
    a, b = two_hosts
    aws = AWSProvider([REGION], session=moto_session(REGION), endpoint_url=moto_url, image_id=moto_image,
                      sleep=lambda s: None)

    wait_for(lambda: b.role() == "standby", 120, "daemon B to wait as a standby", 0.5)
    assert "standby: another daemon leads postgresql+psycopg://" in b.output()
    assert "; waiting" in b.output()
    # spotctl on B's host finds B's API and says, in one line, that B does not lead.
    out = spotctl("status", check=False, env=b.env)
    assert out.returncode != 0 and "this daemon is a standby" in out.stderr, out

    with a.client() as client:
        client.post("/v1/services", json={"yaml": SPEC.format(region=REGION, image=moto_image)}).raise_for_status()
        wait_for(lambda: len(live_instances(aws, "shared")) == 2, 120, "2 instances in moto", 0.5)
        wait_for(lambda: {r["instance_id"] for r in client.get("/v1/services/shared").json()["replicas"]}
                 == {i.instance_id for i in live_instances(aws, "shared")}, 60, "A to record both instances")
    launched = {i.instance_id for i in live_instances(aws, "shared")}
    assert b.role() == "standby"

    a.kill()
    took = time.monotonic()
    wait_for(lambda: b.role() == "leader", 30, "daemon B to take over", 0.2)
    took = time.monotonic() - took
    assert "leading postgresql+psycopg://" in b.output()
    assert took < 20 * POLL_S + 5, f"takeover took {took:.1f}s"

    with b.client() as client:
        wait_for(lambda: client.get("/v1/services/shared").status_code == 200, 30, "B to serve the service")
        time.sleep(10 * POLL_S)  # B's reconciles: each would launch a replica it did not find
        replicas = client.get("/v1/services/shared").json()["replicas"]
        assert {r["instance_id"] for r in replicas} == launched
        assert {i.instance_id for i in live_instances(aws, "shared")} == launched

        client.delete("/v1/services/shared").raise_for_status()
        wait_for(lambda: client.get("/v1/services/shared").status_code == 404, 120, "down through B", 0.5)
    assert live_instances(aws, "shared") == []
    assert alive(b.proc.pid)
