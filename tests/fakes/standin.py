"""Live services on a stand-in engine, for the isolation and fuzz tests and bench_hostile: a
daemon (tests.helpers.running_daemon) serving the named services, one local-cloud replica each,
whose engine is the fake vLLM (tests/fakes/upstream.py), waited for until every one is READY."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.control.launch import ReplicaLauncher
from providers.base import LaunchRequest
from tests.helpers import running_daemon, wait_for

UPSTREAM = Path(__file__).resolve().parent / "upstream.py"
SPEC = """
name: {name}
service:
  readiness_probe: {{path: /health, initial_delay_seconds: 60}}
  replicas: 1
resources: {{cloud: local, use_spot: true}}
engine: {{model: tiny}}
kv: {{enabled: false}}
"""


class StandInLauncher(ReplicaLauncher):
    """Each replica runs the fake vLLM on the port the local cloud gives it."""

    def request(self, spec, row, offer, runtime) -> LaunchRequest:
        return LaunchRequest(service=spec.name, replica_id=row.replica_id, location=offer.location,
                             market=offer.market, instance_type="",
                             command=[sys.executable, str(UPSTREAM), "--port", "{port}", "--name", spec.name])


@contextlib.contextmanager
def services_running(home: Path, names: tuple[str, ...]) -> Iterator[tuple]:
    """(daemon, operator's client, {name: its READY replica as the API shows it}); every service
    goes down on exit."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPOT_ORCHESTRATOR_HOME", str(home))
        with running_daemon(mp, launcher=StandInLauncher()) as (d, client):
            for name in names:
                r = client.post("/v1/services", json={"yaml": SPEC.format(name=name)})
                assert r.status_code == 200, r.text
            replicas = {name: wait_for(lambda name=name: next(
                (r for r in client.get(f"/v1/services/{name}").json()["replicas"] if r["state"] == "READY"), None),
                120, f"a READY replica of {name}") for name in names}
            yield d, client, replicas
