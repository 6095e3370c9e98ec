"""What the migration tests share (the daemon itself comes from tests.helpers.running_daemon):
many concurrent streaming chats through the service's load balancer (the official openai
client), notices, chaos, events and metrics as a user reads them. The replicas are real
processes started by the local cloud: the fake upstream (tests/fakes/upstream.py) in the
fast tests, vLLM CPU in the vllm-marked ones.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai

from orchestrator.control import auth
from orchestrator.control.daemon import Daemon
from orchestrator.control.store import Store
from tests.helpers import spotctl, wait_for


def service(client: httpx.Client, name: str) -> dict:
    r = client.get(f"/v1/services/{name}")
    r.raise_for_status()
    return r.json()


def ready(svc: dict) -> list[dict]:
    return [r for r in svc["replicas"] if r["state"] == "READY"]


def wait_ready(client: httpx.Client, name: str, n: int, timeout: float) -> dict:
    return wait_for(lambda: (lambda s: s if len(ready(s)) >= n else None)(service(client, name)), timeout,
                    f"{n} READY replicas of {name}", 1.0)


def post_notice(client: httpx.Client, name: str, instance_id: str, deadline: float) -> dict:
    """A notice as a replica's agent sends it: authenticated with the replica's own token."""
    replica = next(r for r in service(client, name)["replicas"] if r["instance_id"] == instance_id)
    token = auth.replica_token_for(Store().get_replica(replica["replica_id"]))
    r = client.post("/v1/notices", json={"instance_id": instance_id, "deadline": deadline, "source": "test"},
                    headers={"Authorization": f"Bearer {token}"})
    r.raise_for_status()
    return r.json()


def chaos(*args: str) -> list[str]:
    """`spotctl chaos preempt ...` as a user types it; the replica ids it preempted."""
    return json.loads(spotctl("chaos", "preempt", *args, "--json", timeout=120).stdout)["preempted"]


def events(name: str) -> list[dict]:
    return json.loads(spotctl("events", name, "--limit", "500", "--json", timeout=120).stdout)


def status(name: str) -> dict:
    return json.loads(spotctl("status", name, "--json", timeout=120).stdout)


def metric(url: str, prefix: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def daemon_metric(prefix: str) -> float:
    """The sum of the daemon's /metrics samples that start with `prefix` (the operator's token;
    the migrator's spot_migration_* are there, labelled by service)."""
    from orchestrator.control import discovery

    url = discovery.read_daemon_info()["url"]
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {auth.read_token()}"}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


@dataclass
class Stream:
    """One streamed chat completion through the openai client, read in a thread."""

    index: int
    ids: list[int] = field(default_factory=list)
    text: str = ""
    usage: object = None
    error: str | None = None
    done: bool = False


class Chats:
    """n concurrent greedy streaming chat completions; `wait_tokens(k)` blocks until the
    streams have k tokens (the moment to preempt: mid-stream; the tests check that the victim
    has requests in flight)."""

    def __init__(self, endpoint: str, model: str, n: int, max_tokens: int, timeout: float = 900,
                 topic: str = "rivers"):
        self.client = openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0, timeout=timeout)
        self.model, self.max_tokens, self.topic = model, max_tokens, topic
        self.streams = [Stream(i) for i in range(n)]
        self._threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in self.streams]
        for thread in self._threads:
            thread.start()

    def _run(self, s: Stream) -> None:
        try:
            chunks = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": f"story number {s.index} about {self.topic}"}],
                max_tokens=self.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"return_token_ids": True, "ignore_eos": True})
            for chunk in chunks:
                for choice in chunk.choices:
                    s.ids += choice.model_extra.get("token_ids") or ()
                    s.text += choice.delta.content or ""
                if chunk.usage is not None:
                    s.usage = chunk.usage
            s.done = True
        except Exception as err:  # what the tests are about: reported, not raised in a thread
            s.error = repr(err)

    def wait_tokens(self, k: int, streams: int | None = None, timeout: float = 600) -> None:
        """Until every stream has begun and `streams` of them (default all) have k tokens."""
        need = len(self.streams) if streams is None else streams

        def under_way() -> bool:
            ended = [bool(s.done or s.error) for s in self.streams]
            begun = all(s.ids or e for s, e in zip(self.streams, ended, strict=True))
            return begun and sum(1 for s, e in zip(self.streams, ended, strict=True) if len(s.ids) >= k or e) >= need

        wait_for(under_way, timeout, f"{need} streams to have {k} tokens", 0.01)

    def join(self, timeout: float = 900) -> list[Stream]:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(1.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "streams still running"
        return self.streams


def check_streams(streams: list[Stream], reference: list[Stream]) -> None:
    """No client error, and every stream token for token (and usage) equal to its reference."""
    errors = [s.error for s in streams if s.error]
    assert not errors, f"{len(errors)} of {len(streams)} streams failed: {errors[:3]}"
    for s, ref in zip(streams, reference, strict=True):
        assert s.done
        assert len(s.ids) == len(ref.ids), f"stream {s.index}: {len(s.ids)} tokens, reference {len(ref.ids)}"
        assert s.ids == ref.ids, f"stream {s.index} diverged at token " \
                                 f"{next(i for i, (a, b) in enumerate(zip(s.ids, ref.ids, strict=False)) if a != b)}"
        assert s.text == ref.text
        assert s.usage.completion_tokens == ref.usage.completion_tokens
        assert s.usage.prompt_tokens == ref.usage.prompt_tokens


def migration_data(d: Daemon, replica_id: str, timeout: float = 600) -> dict:
    """What the migrator recorded about the migration of one replica (its event's data)."""
    def find():
        rows = d.store.list_events(kinds=["migration"])
        return next((json.loads(e.data_json) for e in rows if e.replica_id == replica_id), None)

    return wait_for(find, timeout, f"the migration of {replica_id}", 1.0)


def busiest(d: Daemon, name: str, among: list[dict]) -> dict:
    """The replica of `among` with the most requests in flight on the LB right now."""
    lb = d.lbs[name]
    return max(among, key=lambda r: lb.in_flight(r["replica_id"]))
