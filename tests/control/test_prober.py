"""The daemon's one prober: many replicas' readiness checks at once over real HTTP, each one's
answer (200 only), refusals, timeouts and POST probes, in order."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.control.prober import Prober, ProbeTarget
from tests.fakes.clouds import serve

STANDIN = Path(__file__).resolve().parents[1] / "fakes" / "health_standin.py"


@pytest.fixture
def prober():
    p = Prober()
    yield p
    p.close()


@pytest.fixture
def standin():
    proc = subprocess.Popen([sys.executable, str(STANDIN)], stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{proc.stdout.readline().split()[1]}"
    finally:
        proc.kill()
        proc.wait()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_thousand_replicas_behind_one_standin_are_all_ready(prober, standin):
    targets = [ProbeTarget(f"{standin}/m/{i}", "/health", 10.0) for i in range(1000)]
    assert prober.check(targets) == [True] * 1000
    assert prober.check(targets[:3]) == [True] * 3  # again, on the kept connections


def test_each_answer_is_its_own_replicas(prober):
    def route(req):
        if req.path == "/slow/health":
            time.sleep(2)
        if req.method == "POST":
            return (200, "ok") if req.json() == {"ping": 1} and req.headers.get("x-probe") == "yes" else (400, "no")
        return (200, "ok") if req.path.startswith("/up") else (503, "loading")

    with serve(route) as fake:
        got = prober.check([
            ProbeTarget(f"{fake.url}/up", "/health", 5.0),
            ProbeTarget(f"{fake.url}/down", "/health", 5.0),
            ProbeTarget(f"http://127.0.0.1:{closed_port()}", "/health", 5.0),
            ProbeTarget(f"{fake.url}/slow", "/health", 0.5),
            ProbeTarget(fake.url, "/health", 5.0, post_data={"ping": 1}, headers={"x-probe": "yes"}),
            ProbeTarget(fake.url, "/health", 5.0, post_data=json.dumps({"ping": 2})),
        ])
    assert got == [True, False, False, False, True, False]


def test_no_targets_no_answers(prober):
    assert prober.check([]) == []
