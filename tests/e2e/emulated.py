"""The user's whole path on an emulated cloud, written once for every cloud's test:

`spotctl up` of the cloud's template (its engine swapped for the tiny CPU model: the emulated
VMs run vLLM's CPU build) -> replicas READY and serving through the load balancer to the
official `openai` client -> a preemption injected at the emulated metadata service of one
replica, mid-stream -> its own watcher reports the notice -> every stream finishes whole, a
replacement launches -> `spotctl down` -> the cloud holds nothing of the service.

An emulator has `env()`, `preempt(instance_id, grace_s)`, `leftovers(service)` and `runner`
(tests/fakes/vm_runner.VMRunner).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import yaml

from tests.helpers import emulator_running, free_port, spotctl, wait_for

PROMPTS = ["The spot market", "A replica on a cloud", "Erasure codes keep", "The load balancer"]
MAX_TOKENS = 96
# The tiny model in float32: greedy continuations are then token-exact across replicas.
TINY_ENGINE = {"model": "tiny", "dtype": "float32", "max_model_len": 512, "block_size": 32,
               "args": ["--enforce-eager"]}


def emulated_spec(template: Path, out: Path, **service_changes) -> tuple[str, Path]:
    """The template with its engine swapped for the tiny model, a fleet of two (what two CPU
    cores hold: every replica is a vLLM server) and a free load-balancer port; its resources,
    clouds, zones and placement policy as they are."""
    data = yaml.safe_load(template.read_text())
    data["engine"] = dict(TINY_ENGINE)
    service = {k: v for k, v in data.get("service", {}).items() if k != "replica_policy"}
    data["service"] = {**service, "replicas": 2, "ports": free_port(), **service_changes}
    data.pop("envs", None)
    out.write_text(yaml.safe_dump(data))
    return data["name"], out


@contextlib.contextmanager
def emulated(monkeypatch, emulator):
    """emulator_running, plus the daemon's public URL (which the emulator's VMs reach)."""
    with emulator_running(monkeypatch, emulator):
        monkeypatch.setenv("SPOT_ORCHESTRATOR_PUBLIC_URL",
                           f"http://127.0.0.1:{os.environ['SPOT_ORCHESTRATOR_DAEMON_PORT']}")
        yield emulator


class Together:
    """Several emulated clouds as one, for a service that spans them: one VM runner (instance
    ids do not collide across clouds), each call sent to the cloud that owns the instance."""

    def __init__(self, *clouds):
        self.clouds = clouds
        self.runner = clouds[0].runner

    def start(self) -> Together:
        for cloud in self.clouds:
            cloud.start()
        return self

    def env(self) -> dict[str, str]:
        return {k: v for cloud in self.clouds for k, v in cloud.env().items()}

    def close(self) -> None:
        for cloud in self.clouds:
            cloud.close()

    def preempt(self, instance_id: str, grace_s: float) -> float:
        return next(c for c in self.clouds if instance_id in c.metadata).preempt(instance_id, grace_s)

    def leftovers(self, service: str) -> dict[str, list[str]]:
        return {f"{type(c).__name__}.{k}": v for c in self.clouds for k, v in c.leftovers(service).items()}


def status(name: str) -> dict:
    return json.loads(spotctl("status", name, "--json").stdout)


def ready(svc: dict) -> list[dict]:
    return [r for r in svc["replicas"] if r["state"] == "READY"]


class Streams:
    """Streamed completions read in threads; each keeps its text and any error."""

    def __init__(self, client, model: str, prompts: list[str]):
        self.texts = {p: "" for p in prompts}
        self.chunks = dict.fromkeys(prompts, 0)
        self.errors: dict[str, str] = {}
        self.threads = [threading.Thread(target=self._read, args=(client, model, p), daemon=True) for p in prompts]

    def _read(self, client, model: str, prompt: str) -> None:
        try:
            stream = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    self.texts[prompt] += chunk.choices[0].text
                    self.chunks[prompt] += 1
        except Exception as err:  # what the test is about: a client must never see one
            self.errors[prompt] = repr(err)

    def start(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def join(self, timeout_s: float) -> None:
        for t in self.threads:
            t.join(timeout=timeout_s)


def in_flight(endpoint: str) -> dict[str, float]:
    """Requests in flight per replica, from the load balancer's own /metrics."""
    import httpx

    out = {}
    for line in httpx.get(f"{endpoint}/metrics", timeout=10).text.splitlines():
        if line.startswith("spot_lb_in_flight{"):
            labels, _, value = line.rpartition(" ")
            out[labels.split('replica="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def hold_engine(machine) -> None:
    """Stop the victim's engine (not its agent) so its streams stay in flight until the cut:
    the engine is the machine's main process (boot script -> replica main -> exec vLLM)."""
    os.kill(machine.process.pid, signal.SIGSTOP)


def walk(emulator, template: Path, tmp_path: Path, grace_s: float = 90.0, clouds: set[str] | None = None) -> None:
    """The whole path; raises AssertionError naming the step that failed. `clouds`: the clouds
    the plan must use (default: the one the template is named after). The busiest spot replica's
    whole zone is preempted: every READY replica there."""
    import openai

    name, spec = emulated_spec(template, tmp_path / template.name)
    plan = json.loads(spotctl("up", str(spec), "--dry-run", "--json").stdout)
    assert plan and {p["cloud"] for p in plan} == (clouds or {template.stem}), plan
    try:
        spotctl("up", str(spec))
        def two_ready() -> dict | None:
            svc = status(name)
            return svc if len(ready(svc)) >= 2 else None

        svc = wait_for(two_ready, 1200, "2 READY replicas", 2.0)
        client = openai.OpenAI(base_url=svc["endpoint"] + "/v1", api_key="unused", max_retries=0, timeout=600)
        reference = {p: client.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                     .choices[0].text for p in PROMPTS}
        assert all(reference.values()), reference

        streams = Streams(client, name, PROMPTS).start()
        wait_for(lambda: all(n >= 8 for n in streams.chunks.values()) or streams.errors, 300,
                 "every stream under way", 0.05)
        busiest = max(in_flight(svc["endpoint"]).items(), key=lambda kv: kv[1], default=(None, 0))
        assert busiest[1] >= 1, f"no replica has a stream in flight: {in_flight(svc['endpoint'])}"
        victim = next(r for r in ready(status(name)) if r["replica_id"] == busiest[0])
        assert victim["market"] == "spot", f"the busiest replica is not a spot one: {victim}"
        zone = [r for r in ready(status(name)) if r["market"] == "spot"
                and (r["cloud"], r["zone"]) == (victim["cloud"], victim["zone"])]
        for replica in zone:
            hold_engine(emulator.runner.machines[replica["instance_id"]])
        noticed_at = time.time()
        for replica in zone:
            emulator.preempt(replica["instance_id"], grace_s)
        streams.join(900)
        assert not streams.errors, f"streams failed across the preemption: {streams.errors}"
        assert streams.texts == reference, "a stream lost or repeated tokens across the preemption"

        events = json.loads(spotctl("events", name, "--json", "--limit", "500").stdout)
        drained = [e for e in events if e["replica_id"] == victim["replica_id"] and "-> DRAINING" in e["message"]]
        assert drained and f"notice from {victim['cloud']}:" in drained[0]["message"], \
            f"the replica's own watcher never reported the notice: {drained}"
        moved = [e for e in events if e["kind"] == "migration" and e["replica_id"] == victim["replica_id"]]
        n = int(busiest[1])
        assert moved and moved[0]["message"].startswith(f"{n}/{n} streams continued"), moved
        assert any(e["kind"] == "launch" and e["at"] >= noticed_at for e in events), "no replacement launched"
        def victim_gone() -> bool:
            states = {r["replica_id"]: r["state"] for r in status(name)["replicas"]}
            return states.get(victim["replica_id"]) in ("PREEMPTED", "TERMINATED")

        wait_for(victim_gone, grace_s + 120, "the victim gone at its deadline", 2.0)
    finally:
        print(spotctl("events", name, "--limit", "300", check=False).stdout)
        print(emulator.runner.logs())
        spotctl("down", name, "-y", "--timeout", "600", check=False)
    try:
        left = emulator.leftovers(name)
        assert not any(left.values()), f"the cloud still holds things of {name} after down: {left}"
        wait_for(lambda: not emulator.runner.running(), 60, "every machine gone")
    finally:
        stop_daemon()


def stop_daemon() -> None:
    from orchestrator.control.discovery import read_daemon_info

    info = read_daemon_info()
    if info:
        try:
            os.kill(int(info["pid"]), signal.SIGTERM)
        except (ProcessLookupError, KeyError, ValueError):
            pass
