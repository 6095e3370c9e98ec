"""The service verbs through the real CLI (subprocesses), against a running daemon."""

from __future__ import annotations

import json

from tests.helpers import spotctl
from tests.control.test_daemon import SPEC, daemon, ready, wait_for  # noqa: F401 - `daemon` is a fixture


def test_status_logs_events_and_down_through_the_cli(daemon, tmp_path):  # noqa: F811
    _, client = daemon
    spec = tmp_path / "svc.yaml"
    spec.write_text(SPEC)
    out = json.loads(spotctl("up", str(spec), "--json", timeout=120).stdout)
    assert out["name"] == "svc" and out["endpoint"].startswith("http://127.0.0.1:")
    wait_for(lambda: len(ready(client)) == 2, 60, "2 READY replicas")

    status = json.loads(spotctl("status", "--json", timeout=120).stdout)
    (svc,) = status
    assert svc["name"] == "svc" and svc["status"] == "READY" and svc["replicas_ready"] == 2
    for r in svc["replicas"]:
        assert {"replica_id", "zone", "market", "state", "endpoint", "launched_at", "price_per_hour"} <= set(r)
    table = spotctl("status", "-v", timeout=120, env={"COLUMNS": "250"}).stdout
    assert "svc-1" in table and "READY" in table and "hazard_hedge" in table

    print(spotctl("events", "svc", "--limit", "100", timeout=120, env={"COLUMNS": "250"}).stdout)
    logs = spotctl("logs", "svc", "svc-1", timeout=120).stdout
    assert "fake engine svc listening" in logs
    events = json.loads(spotctl("events", "svc", "--json", timeout=120).stdout)
    assert any(e["kind"] == "launch" for e in events)

    chaos = json.loads(spotctl("chaos", "preempt", "svc-1", "--grace", "1", "--json", timeout=120).stdout)
    assert chaos["preempted"] == ["svc-1"]
    wait_for(lambda: any(r["replica_id"] == "svc-1" and r["state"] == "PREEMPTED"
                         for r in client.get("/v1/services/svc").json()["replicas"]), 30, "svc-1 PREEMPTED")
    assert "PREEMPTED" in spotctl("status", "svc", timeout=120, env={"COLUMNS": "250"}).stdout

    spotctl("down", "svc", "-y", "--timeout", "60", timeout=120)
    assert client.get("/v1/services/svc").status_code == 404
