"""End to end on the local cloud: spotctl -> daemon -> 2 real vLLM CPU replicas -> load balancer.

Real processes throughout: the daemon is started by `spotctl up` in the background, the
replicas are vLLM OpenAI servers of the tiny demo model, the client is the official openai
package talking to the load balancer.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import alive, spotctl, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

SPEC = """
name: e2e
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 600
  replicas: 2
resources:
  cloud: local
  use_spot: true
  any_of:
    - zone: local-a
    - zone: local-b
engine:
  model: tiny
  max_model_len: 512
kv:
  enabled: false
"""


def _status(name: str) -> dict:
    return json.loads(spotctl("status", name, "--json").stdout)


def _wait(predicate, timeout: float, what: str):
    return wait_for(predicate, timeout, what, interval=1.0)  # each poll runs `spotctl status`


def _status_if(condition) -> dict | None:
    svc = _status("e2e")
    return svc if condition(svc) else None


def _ready(svc: dict) -> list[dict]:
    return [r for r in svc["replicas"] if r["state"] == "READY"]


def _instance_pids(home: Path) -> dict[str, int]:
    """instance id -> pid, from the local cloud's on-disk registry (what a user's `ps` shows)."""
    out = {}
    for f in (home / "local-cloud").rglob("*.json"):
        try:
            rec = json.loads(f.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        if isinstance(rec, dict) and "pid" in rec and "instance_id" in rec:
            out[rec["instance_id"]] = rec["pid"]
    return out


def test_service_end_to_end(tmp_path, state_home, replica_runtime):
    import openai

    spec = tmp_path / "e2e.yaml"
    spec.write_text(SPEC)
    try:
        spotctl("up", str(spec), "--wait", "--timeout", "900")
        svc = _wait(lambda: _status_if(lambda s: len(_ready(s)) == 2), 600, "2 READY replicas")
        assert {r["zone"] for r in _ready(svc)} == {"local-a", "local-b"}
        client = openai.OpenAI(base_url=svc["endpoint"] + "/v1", api_key="unused", max_retries=0, timeout=120)

        done = client.completions.create(model="e2e", prompt="The quick brown fox", max_tokens=8, temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens == 8

        chunks = client.chat.completions.create(
            model="e2e", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert pieces, "the streamed chat completion produced no tokens"

        # Kill one replica's process from outside while requests keep flowing: none may fail.
        victim = _ready(svc)[0]
        pids = _instance_pids(state_home)
        assert victim["instance_id"] in pids
        errors: list[str] = []
        served = []
        stop = threading.Event()

        def traffic():
            while not stop.is_set():
                try:
                    r = client.completions.create(model="e2e", prompt="Hello", max_tokens=4, temperature=0)
                    served.append(r.choices[0].text)
                except Exception as err:  # any failure is what this test is about
                    errors.append(repr(err))

        worker = threading.Thread(target=traffic)
        worker.start()
        time.sleep(2)
        os.killpg(pids[victim["instance_id"]], signal.SIGKILL)
        replaced = _wait(
            lambda: _status_if(
                lambda s: len(_ready(s)) >= 2 and victim["replica_id"] not in {r["replica_id"] for r in _ready(s)}
            ),
            600,
            "a replacement replica to become READY",
        )
        stop.set()
        worker.join(timeout=300)
        assert not errors, f"requests failed while a replica died: {errors[:3]}"
        assert len(served) > 3
        states = {r["replica_id"]: r["state"] for r in replaced["replicas"]}
        assert states[victim["replica_id"]] in ("PREEMPTED", "FAILED")

        all_pids = _instance_pids(state_home)
        spotctl("down", "e2e", "-y", "--timeout", "120")
        leftovers = [pid for pid in all_pids.values() if alive(pid)]
        assert not leftovers, f"processes left behind after down: {leftovers}"
    finally:
        print(spotctl("events", "--limit", "200", check=False).stdout)  # shown when the test fails
        spotctl("down", "--all", "-y", "--timeout", "60", check=False)
        info = state_home / "daemon.json"
        if info.exists():
            try:
                os.kill(json.loads(info.read_text())["pid"], signal.SIGTERM)
            except (ProcessLookupError, KeyError, json.JSONDecodeError):
                pass
