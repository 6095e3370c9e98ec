"""Helpers shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAKES = REPO / "tests" / "fakes"  # the shared stand-ins (engines, clouds, stores)
BENCHMARKS = REPO / "tests" / "benchmarks"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spotctl(*args: str, check: bool = True, timeout: float = 900, env: dict | None = None):
    """Run the real CLI as a user would (a subprocess of the control-plane venv)."""
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"spotctl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def wait_for(predicate, timeout: float = 60.0, what: str = "condition", interval: float = 0.2):
    """predicate()'s first truthy value, polled every `interval` s; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def alive(pid: int) -> bool:
    """Alive and not a zombie (a zombie still answers os.kill(pid, 0)). Asked of psutil here,
    not through orchestrator.common.procs, so a test does not trust the code it checks."""
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def stop_autostarted_daemon(grace_s: float = 15.0, home: Path | None = None) -> None:
    """Stop the daemon a spotctl verb started in this test's SPOT_ORCHESTRATOR_HOME (or `home`),
    if any, and the data plane it left serving (SIGTERM, then SIGKILL after `grace_s`)."""
    import json

    from orchestrator.common import paths

    home = home or paths.home()
    for record in ("daemon.json", "dataplane.json"):
        try:
            pid = int(json.loads((home / record).read_text()).get("pid", 0))
        except (OSError, ValueError):
            continue
        stop_process(pid, grace_s)


def stop_process(pid: int, grace_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; not this process, not one already gone."""
    import signal

    if pid <= 0 or pid == os.getpid() or not alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def moto_session(region: str = "us-east-1"):
    """A boto3 session with the fake credentials moto accepts."""
    import boto3  # here, not at the top: conftest imports this module for every test

    return boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=region)


@contextlib.contextmanager
def running_daemon(monkeypatch, *, probe_interval_s: float | None = 0.5, keep_services: bool = False,
                   **daemon_kwargs) -> Iterator[tuple]:
    """(daemon, client with its token): a daemon's API and jobs in this process on a free port,
    reconciling every 0.5 s (probing too, unless probe_interval_s is None). On exit every service
    is taken down (keep_services=True leaves them for a restarted daemon to adopt), the server
    stops, and the local cloud's timers are closed."""
    import httpx  # the daemon's stack is heavy: only the tests that run one import it

    from orchestrator.control.daemon import Daemon, DaemonServer
    from orchestrator.control.store import Store
    from providers.local import LocalProvider

    monkeypatch.setattr("orchestrator.control.daemon.RECONCILE_INTERVAL_S", 0.5)
    if probe_interval_s is not None:
        monkeypatch.setattr("orchestrator.control.daemon.PROBE_INTERVAL_S", probe_interval_s)
    daemon = Daemon(store=Store(), **daemon_kwargs)
    server = DaemonServer(daemon, "127.0.0.1", 0)
    server.start_in_thread()
    client = httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}, timeout=60)
    try:
        yield daemon, client
    finally:
        try:
            if not keep_services:
                for svc in client.get("/v1/services").json():
                    client.delete(f"/v1/services/{svc['name']}")
                wait_for(lambda: not client.get("/v1/services").json(), 180, "services to go down", 0.5)  # vLLM: slow
        finally:
            server.stop()
            if "local" in daemon.providers:
                LocalProvider().close()


@contextlib.contextmanager
def emulator_running(monkeypatch, emulator):
    """An emulated cloud (tests/fakes/emulated_*) started, its settings in this process's
    environment (spotctl and the daemon it starts inherit them); closed after."""
    emulator.start()
    try:
        for key, value in emulator.env().items():
            monkeypatch.setenv(key, value)
        yield emulator
    finally:
        emulator.close()


def vm_cloud_daemon(monkeypatch, factory, **kwargs):
    """running_daemon on a VM cloud whose VMs boot nothing here: no engine answers, so probing is
    left at its own pace; the URL its VMs would reach it at is only named in their boot scripts."""
    return running_daemon(monkeypatch, probe_interval_s=None, provider_factory=factory,
                          public_url="http://127.0.0.1:9", **kwargs)


def live_instances(provider, service: str) -> list:
    """The provider's instances of `service` that are not terminated."""
    from providers.base import TAG_SERVICE, InstanceStatus

    return [i for i in provider.list({TAG_SERVICE: service}) if i.status is not InstanceStatus.TERMINATED]


def environment_provider(cls, cloud: str):
    """A provider factory for running_daemon: `cls` built with no arguments, configured from the
    environment only, as the daemon builds it (no sleeping between retries)."""

    def make(name: str):
        assert name == cloud, name
        return cls(sleep=lambda s: None)

    return make



def restart_adopts_then_down(monkeypatch, factory, service: str, managed, instance_ids: set[str]) -> None:
    """A new daemon on the same state finds the service's instances (`managed()` still gives the
    same ids after three reconciles: nothing new launched), then `down` takes the service away."""
    with vm_cloud_daemon(monkeypatch, factory) as (daemon, client):
        wait_for(lambda: client.get(f"/v1/services/{service}").status_code == 200, 10, "the service restored")
        wait_for(lambda: daemon.controllers[service].reconciles >= 3, 60, "three full reconciles")
        assert {i.instance_id for i in managed()} == instance_ids
        client.delete(f"/v1/services/{service}").raise_for_status()
        wait_for(lambda: client.get(f"/v1/services/{service}").status_code == 404, 60, "down")
