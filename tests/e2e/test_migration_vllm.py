"""End to end: a preemption no client can see, with real vLLM CPU replicas.

spotctl/daemon (in this process) -> local cloud -> replicas = agent (shard store) + vLLM CPU
with SpotKVConnector (k=4, m=2, membership from the daemon) -> the service's load balancer
-> 16 concurrent greedy streaming chats through the official openai client. Each scenario
runs 16 prompts of its own twice: a reference run, then the same prompts with the
preemption; every stream must equal, token for token, its reference run on the same
service. Before each preemption run the replicas' own prefix caches are emptied (vLLM's
dev endpoint), so a continuation's prefix can only come from the shard stores or be
recomputed, never from a replica that served the prompt before.

The replicas compute in float32: a random-weight model's next-token scores are close, and
bfloat16 rounding that depends on how requests are batched (it changes when a replica takes
over another's streams) flips near ties far after the seam, in runs with and without a
preemption alike; float32 keeps those ties apart.

One service serves every scenario (a vLLM start costs minutes on two shared cores), and a
launch budget wrapped around the even_spread policy keeps the fleet to what the next
scenario needs:
1. 3 replicas in 3 zones; `spotctl chaos preempt REPLICA --grace 30` mid-stream: the
   continuations load their prefixes from the shards, recompute at most the last block;
2. the service grows to 4 (two in one zone); `spotctl chaos preempt --zone` takes both at
   once, and their zone's shard stores with them: k=4, m=2 keeps at most 2 shards of a block
   per zone, and the continuations load from the other zones' 4;
3+4. every shard store killed, then a notice whose deadline already passed (POST
   /v1/notices, as an agent sends it): an immediate loss with nothing to load; the
   continuations recompute, no client sees an error, and the metrics say so. (Both in one
   scenario to save a vLLM start; tests/control/test_migration.py covers a late notice on its own.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from orchestrator.control import launch as replica_command
from policies.base import Decision, PlacementPolicy, load_policy
from tests.helpers import running_daemon, wait_for
from tests.fakes.migration_harness import (
    daemon_metric,
    Chats,
    chaos,
    check_streams,
    events,
    migration_data,
    metric,
    post_notice,
    ready,
    service,
    status,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

SPEC = """
name: mig
service:
  # A victim held (SIGSTOP) while the test waits for a second one fails its probes: long
  # enough, and the controller would tear it down as failed before the notice.
  readiness_probe: {{path: /health, initial_delay_seconds: 1200, consecutive_failure_threshold_timeout: 1200}}
  replicas: {replicas}
  placement_policy: even_spread
resources:
  cloud: local
  use_spot: true
  any_of: [{{zone: local-a}}, {{zone: local-b}}, {{zone: local-c}}]
engine:
  model: tiny
  max_model_len: 1024
  dtype: float32
kv:
  enabled: true
  k: 4
  m: 2
"""
# Long streams: a victim is held (SIGSTOP) the moment its streams have CUT_AT tokens, and a
# poll of the LB from a busy test process can come late; 480 tokens leave it seconds.
STREAMS, MAX_TOKENS, CUT_AT = 16, 480, 40
BLOCK = 32  # the CPU build's KV block size (spec default on the local cloud)
START_S = 1500  # vLLM starts, several at once, on a loaded 2-core machine


class LaunchBudget:
    """How many replicas the policy may still launch; the test adds to it per scenario."""

    def __init__(self, n: int):
        self.left = n
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.left += n


class Budgeted(PlacementPolicy):
    """The configured policy, with its launches cut to the budget (removals untouched)."""

    def __init__(self, inner: PlacementPolicy, budget: LaunchBudget):
        self.inner, self.budget = inner, budget
        self.name = inner.name

    def observe(self, event) -> None:
        self.inner.observe(event)

    def decide(self, view) -> Decision:
        decision = self.inner.decide(view)
        with self.budget.lock:
            launches = decision.launches[: max(0, self.budget.left)]
            self.budget.left -= len(launches)
        return dataclasses.replace(decision, launches=launches)


def _pids(module: str, port_flag: str, endpoints: set[str]) -> list[int]:
    """The processes running `python -m module ... port_flag PORT` for these endpoints' ports."""
    ports = {e.rsplit(":", 1)[1] for e in endpoints}
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        args = proc.info["cmdline"] or []  # None: not ours to read
        if module in args and port_flag in args and args[args.index(port_flag) + 1] in ports:
            pids.append(proc.pid)
    return pids


def _agent_pids(agent_endpoints: set[str]) -> list[int]:
    """The agents (shard stores) serving these endpoints, found by their command lines."""
    return _pids("orchestrator.replica.agent", "--store-port", agent_endpoints)


def _kill_agents(endpoints: set[str]) -> None:
    """SIGKILL the shard stores at these endpoints (the test's own daemon started them)."""
    pids = _agent_pids(endpoints)
    assert pids, f"no agent process found for {sorted(endpoints)}"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _agent_pids(endpoints), 60, "the agents to be gone", 0.5)


def _process_groups(replicas: list[dict]) -> list[int]:
    """The process groups of these replicas (vLLM, its engine and its agent share one)."""
    servers = _pids("vllm.entrypoints.openai.api_server", "--port", {r["endpoint"] for r in replicas})
    assert len(servers) == len(replicas), f"vLLM servers of {[r['replica_id'] for r in replicas]}: {servers}"
    return sorted({os.getpgid(pid) for pid in servers})


def _mid_stream(lb, replica_id: str) -> bool:
    """Streams in flight on the replica, each with CUT_AT tokens or more."""
    tokens = lb.streamed_tokens(replica_id)
    return bool(tokens) and min(tokens) >= CUT_AT


class _Missed(Exception):
    """Every candidate's streams ended before one could be held mid-stream; no notice went
    out, and the run is repeated."""


def _still_streaming_once_read(lb, replica_id: str, steady_s: float = 1.0) -> bool:
    """Whether streams are still in flight on a held replica once the LB has read what it had
    already sent. A replica can run hundreds of tokens ahead of a busy LB, and its sockets hold
    them: a stream that looked half done can still finish from there."""
    last, since = None, time.monotonic()
    while time.monotonic() - since < steady_s:
        tokens = sorted(lb.streamed_tokens(replica_id))
        if tokens != last:
            last, since = tokens, time.monotonic()
        time.sleep(0.05)
    return bool(last)


@contextlib.contextmanager
def _held(lb, candidates: list[dict], count: int):
    """SIGSTOP `count` of the candidate replicas, each the moment it is mid-stream; yields them
    held (the notice goes out then) and SIGCONTs them after. Raises _Missed, before any
    notice, when too few candidates are left with streams to hold.

    Replicas on two shared cores do not advance alike: the OS lets one run ahead and finish
    its streams while another's are still starting, and `spotctl chaos` on a loaded machine
    takes seconds. Held, a victim cannot finish its streams before the cut; resumed, it
    answers the flush the migrator sent it meanwhile (queued in its socket, well inside the
    flush timeout). What the clients had when the cut came is all it had generated."""
    held: list[dict] = []
    spent: list[dict] = []  # held too late: their streams ended from what the sockets held
    groups: list[int] = []

    def release(stopped: list[int]) -> None:
        for group in stopped:
            with contextlib.suppress(ProcessLookupError):  # a lost notice ends it at once
                os.killpg(group, signal.SIGCONT)

    try:
        def hold_ready() -> bool:
            for r in candidates:
                if r in held or r in spent or not _mid_stream(lb, r["replica_id"]):
                    continue
                stopped = _process_groups([r])
                for group in stopped:
                    os.killpg(group, signal.SIGSTOP)
                groups.extend(stopped)
                if _still_streaming_once_read(lb, r["replica_id"]):
                    held.append(r)
                else:
                    release(stopped)
                    spent.append(r)
            if len(held) >= count:
                return True
            if len(candidates) - len(spent) < count:
                raise _Missed(f"the streams of {[r['replica_id'] for r in spent]} ended before they were held")
            return False

        wait_for(hold_ready, 600, f"{count} of {[r['replica_id'] for r in candidates]} mid-stream", 0.01)
        yield held[:count]
    finally:
        release(groups)


def _states(client) -> dict[str, str]:
    return {r["replica_id"]: r["state"] for r in service(client, "mig")["replicas"]}


def _reset_prefix_caches(client) -> None:
    for r in service(client, "mig")["replicas"]:
        if r["state"] == "READY":
            wait_for(lambda r=r: httpx.post(f"{r['endpoint']}/reset_prefix_cache", timeout=60).json()["success"],
                     120, f"{r['replica_id']} to empty its prefix cache", 1)


def _preempt_mid_stream(d, client, lb_url, topic, preempt):
    """The reference run of 16 prompts on `topic`, then the same 16 again; once they are under
    way, `preempt()` (returns the victims). Every stream must equal its reference.

    Fresh prompts per scenario: a replica does not push again blocks it stored before, and
    the stores an earlier scenario lost took some shards of those blocks with them."""
    reference = Chats(lb_url, "mig", STREAMS, MAX_TOKENS, topic=topic).join()
    assert not [s.error for s in reference if s.error]
    assert all(len(s.ids) == MAX_TOKENS for s in reference)
    assert len({tuple(s.ids) for s in reference}) == STREAMS  # 16 different streams
    for _attempt in range(3):
        _reset_prefix_caches(client)
        chats = Chats(lb_url, "mig", STREAMS, MAX_TOKENS, topic=topic)
        try:
            victims = preempt()  # each victim held the moment its streams have CUT_AT tokens
        except _Missed as missed:
            check_streams(chats.join(), reference)  # no notice went out: the same prompts again
            print(f"{topic}: {missed}; running the prompts again")
            continue
        check_streams(chats.join(), reference)
        return victims
    pytest.fail(f"{topic}: three runs in a row ended before a victim could be held mid-stream")


def test_preemptions_no_client_sees(state_home, tiny_model, monkeypatch):
    monkeypatch.setitem(replica_command.REPLICA_ENV, "VLLM_SERVER_DEV_MODE", "1")  # /reset_prefix_cache
    budget = LaunchBudget(3)
    with running_daemon(monkeypatch, policy_factory=lambda name: Budgeted(load_policy(name), budget)) as (d, client):
        client.post("/v1/services", json={"yaml": SPEC.format(replicas=3)}).raise_for_status()
        svc = wait_ready(client, "mig", 3, START_S)
        assert sorted(r["zone"] for r in ready(svc)) == ["local-a", "local-b", "local-c"]
        lb_url = svc["endpoint"]

        # 1. One replica, 30 s notice, through the CLI.
        def preempt_one():
            with _held(d.lbs["mig"], ready(svc), 1) as (victim,):
                assert d.lbs["mig"].in_flight(victim["replica_id"]) > 0
                assert chaos(victim["replica_id"], "--grace", "30") == [victim["replica_id"]]
            assert _states(client)[victim["replica_id"]] == "DRAINING"
            return [victim["replica_id"]]

        (first,) = _preempt_mid_stream(d, client, lb_url, "rivers", preempt_one)
        data = migration_data(d, first)
        assert data["requests"] > 0 and data["failed"] == 0 and data["resumed"] == data["requests"], data
        assert data["continuations"] == data["requests"], data  # B's records: one per continuation
        assert data["loaded_tokens"] >= BLOCK * data["requests"]  # the prefixes came from the shards
        assert data["max_recomputed_tokens"] <= BLOCK, data  # at most the last partial block
        assert metric(lb_url, 'spot_lb_migrations_total{mode="resume",reason="cut"}') == data["requests"]
        assert daemon_metric('spot_migration_kv_loaded_tokens_total{service="mig"}') == data["loaded_tokens"]
        assert daemon_metric('spot_migration_flushes_total{result="ok",service="mig"}') == 1
        assert metric(lb_url, "spot_lb_stall_seconds_count") == data["requests"]
        wait_for(lambda: _states(client)[first] == "PREEMPTED", 120, "the victim to be PREEMPTED", 1)
        assert {r["replica_id"]: r["state"] for r in status("mig")["replicas"]}[first] == "PREEMPTED"
        kinds = {e["kind"] for e in events("mig") if e["replica_id"] == first}
        assert {"chaos", "notice", "migration", "preempted"} <= kinds

        # 2. Four replicas, two in one zone; the whole zone at once, its shard stores lost with
        #    it: k=4, m=2 puts at most 2 shards of a block in a zone, the other zones have 4.
        budget.add(2)
        client.post("/v1/services", json={"yaml": SPEC.format(replicas=4)}).raise_for_status()
        svc = wait_ready(client, "mig", 4, START_S)
        zones = [r["zone"] for r in ready(svc)]
        crowded = max(set(zones), key=zones.count)
        assert zones.count(crowded) == 2

        def preempt_zone():
            victims = [r for r in ready(svc) if r["zone"] == crowded]
            with _held(d.lbs["mig"], victims, 2):
                _kill_agents({r["agent_endpoint"] for r in victims})
                assert sum(d.lbs["mig"].in_flight(r["replica_id"]) for r in victims) > 0
                return chaos("--zone", crowded, "--grace", "30")

        pair = _preempt_mid_stream(d, client, lb_url, "mountains", preempt_zone)
        assert len(pair) == 2
        moved = [migration_data(d, victim) for victim in pair]
        requests = sum(m["requests"] for m in moved)
        assert requests > 0 and all(m["failed"] == 0 for m in moved)
        kv = moved[0]  # the KV numbers are those of both victims' continuations together
        assert kv["batch"] == sorted(pair) and kv["continuations"] == requests, moved
        assert kv["loaded_tokens"] >= BLOCK * requests, moved
        assert kv["max_recomputed_tokens"] <= BLOCK, moved
        assert metric(lb_url, "spot_lb_continuation_failures_total") == 0

        # 3+4. Every shard store gone, then a notice whose deadline has passed: recompute.
        svc = service(client, "mig")
        live = ready(svc)
        assert len(live) == 2
        _kill_agents({r["agent_endpoint"] for r in svc["replicas"] if r["agent_endpoint"]})
        loaded_before = daemon_metric('spot_migration_kv_loaded_tokens_total{service="mig"}')
        recomputed_before = daemon_metric('spot_migration_kv_recomputed_tokens_total{service="mig"}')

        def notice_too_late():
            with _held(d.lbs["mig"], live, 1) as (victim,):
                assert d.lbs["mig"].in_flight(victim["replica_id"]) > 0
                handled = post_notice(client, "mig", victim["instance_id"], time.time() - 1)
            assert handled["replica_id"] == victim["replica_id"]
            return [victim["replica_id"]]

        (last,) = _preempt_mid_stream(d, client, lb_url, "forests", notice_too_late)
        data = migration_data(d, last)
        assert data["lost"] and data["requests"] > 0 and data["failed"] == 0
        assert data["continuations"] == data["requests"], data
        assert data["loaded_tokens"] == 0 and data["recomputed_tokens"] > 0
        assert daemon_metric('spot_migration_kv_loaded_tokens_total{service="mig"}') == loaded_before
        assert daemon_metric('spot_migration_kv_recomputed_tokens_total{service="mig"}') > recomputed_before
        assert daemon_metric('spot_migration_notices_total{outcome="lost",service="mig"}') == 1
        assert daemon_metric('spot_migration_flushes_total{result="skipped",service="mig"}') == 1
        assert metric(lb_url, "spot_lb_continuation_failures_total") == 0
        wait_for(lambda: _states(client)[last] in ("PREEMPTED", "TERMINATED"), 120, "the lost replica gone", 1)
