"""The shard store: real agents on 127.0.0.1, real HTTP; auth, bounds, TTL, concurrency, failures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest

from orchestrator.replica.kv.wire import HEAD_BYTES
from orchestrator.replica.kv.store import ShardMemory, StoreClient, StoreUnavailable, gather_until
from tests.fakes.kv_stores import SECRET, StoreProcess, agent_python, rss_bytes, secret_file
from tests.helpers import BENCHMARKS


@pytest.fixture
def store(tmp_path):
    proc = StoreProcess(secret_file(tmp_path), max_bytes=64 << 20)
    yield proc
    proc.kill()


@pytest.fixture
def client(store):
    c = StoreClient(store.endpoint, SECRET, timeout_s=10)
    yield c
    c.close()


def metrics(endpoint: str) -> dict[str, float]:
    text = httpx.get(f"{endpoint}/metrics", headers={"authorization": f"Bearer {SECRET}"}).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_every_route_needs_the_secret(store):
    for method, path in [("GET", "/v1/shards/a"), ("PUT", "/v1/shards/a"), ("HEAD", "/v1/shards/a"),
                         ("DELETE", "/v1/shards/a"), ("POST", "/v1/batch/get"), ("GET", "/metrics"),
                         ("GET", "/healthz")]:
        assert httpx.request(method, store.endpoint + path, content=b"x").status_code == 401
        wrong = {"authorization": "Bearer not-the-secret"}
        assert httpx.request(method, store.endpoint + path, content=b"x", headers=wrong).status_code == 401
    assert metrics(store.endpoint)["spot_kv_store_unauthorized_total"] == 14


def test_wrong_secret_in_the_client_is_a_clear_error(store):
    bad = StoreClient(store.endpoint, "wrong", timeout_s=5)
    with pytest.raises(StoreUnavailable, match="401"):
        bad.put("k", b"v")
    bad.close()


def test_single_and_batch_round_trips(client):
    assert client.put("a/b c#0", b"one")
    assert client.get("a/b c#0") == b"one"
    assert client.has("a/b c#0") and not client.has("nope")
    assert client.get("nope") is None
    items = [(f"k\u00e9{i}", os.urandom(1000 + i)) for i in range(50)]
    assert client.put_many(items) == [True] * 50
    got = client.get_many([k for k, _ in items] + ["absent"])
    assert [bytes(v) for v in got[:-1]] == [v for _, v in items] and got[-1] is None
    assert client.has_many(["k\u00e91", "absent"]) == [True, False]
    assert client.delete_many(["k\u00e91", "absent"]) == [True, False]
    assert client.delete("a/b c#0") and not client.delete("a/b c#0")
    assert client.get("k\u00e91") is None


def test_memory_bound_holds_under_a_flood(tmp_path):
    bound = 8 << 20
    store = StoreProcess(secret_file(tmp_path), max_bytes=bound)
    try:
        before = rss_bytes(store.pid)
        value = os.urandom(1 << 20)

        def flood(worker: int) -> None:
            c = StoreClient(store.endpoint, SECRET, timeout_s=30)
            for i in range(64):  # 4 x 64 MiB sent into an 8 MiB store
                c.put_many([(f"w{worker}-{i}-{j}", value) for j in range(1)])
                c.put(f"w{worker}-{i}-single", value)
            c.close()

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(flood, range(4)))
        seen = metrics(store.endpoint)
        assert seen["spot_kv_store_bytes"] <= bound
        assert seen["spot_kv_store_items"] <= bound // len(value)
        assert seen["spot_kv_store_evictions_total{reason=\"lru\"}"] >= 4 * 128 - bound // len(value)
        # held memory stays near the bound (not the 512 MiB that went through)
        assert rss_bytes(store.pid) - before < 6 * bound + (64 << 20)
        c = StoreClient(store.endpoint, SECRET)
        assert c.put("last", value) and c.get("last") == value  # the newest survive (LRU)
        assert c.get("w0-0-0") is None
        c.close()
    finally:
        store.kill()


def test_a_shard_larger_than_the_bound_is_refused(tmp_path):
    store = StoreProcess(secret_file(tmp_path), max_bytes=1 << 20)
    c = StoreClient(store.endpoint, SECRET)
    try:
        assert not c.put("big", b"x" * (2 << 20))
        assert c.put_many([("big", b"x" * (3 << 19)), ("small", b"y")]) == [False, True]
        assert metrics(store.endpoint)["spot_kv_store_rejected_total"] == 2
        # a body the store could never hold is refused whole (413) before it is buffered
        assert c.put_many([("a", b"x" * (1 << 20)), ("b", b"x" * (1 << 20)), ("c", b"y")]) == [False] * 3
        assert c.get("small") == b"y"  # and the store (and this connection pool) carry on
    finally:
        c.close()
        store.kill()


def test_shards_expire_after_their_ttl(tmp_path):
    store = StoreProcess(secret_file(tmp_path), ttl_s=0.5)
    c = StoreClient(store.endpoint, SECRET)
    try:
        assert c.put("short-lived", b"v")
        deadline = time.monotonic() + 30
        while c.has("short-lived") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not c.has("short-lived")
        assert metrics(store.endpoint)["spot_kv_store_evictions_total{reason=\"ttl\"}"] == 1
    finally:
        c.close()
        store.kill()


def test_head_returns_each_values_first_bytes_without_refreshing_it(client):
    long, short = os.urandom(5000), b"tiny"
    assert client.put_many([("long", long), ("short", short)]) == [True, True]
    heads = client.head_many(["long", "absent", "short"])
    assert bytes(heads[0]) == long[:HEAD_BYTES] and heads[1] is None and bytes(heads[2]) == short
    now = [0.0]
    mem = ShardMemory(max_bytes=20, ttl_s=10, clock=lambda: now[0])
    assert mem.put("a", b"x" * 9) and mem.put("b", b"x" * 9)
    assert mem.peek("a") == b"x" * 9  # not a touch: a stays the least recently used
    assert mem.put("c", b"x" * 9) and not mem.has("a") and mem.has("b")


def test_memory_lru_and_ttl_accounting():
    now = [0.0]
    mem = ShardMemory(max_bytes=30, ttl_s=10, clock=lambda: now[0])
    assert mem.put("a", b"x" * 9) and mem.put("b", b"x" * 9) and mem.put("c", b"x" * 9)
    assert mem.bytes == 30
    assert mem.get("a") is not None  # a is now the most recent
    assert mem.put("d", b"x" * 9)  # evicts b, the least recently used
    assert mem.has("a") and not mem.has("b") and mem.stats.lru_evictions == 1
    assert mem.put("a", b"y")  # replacing frees the old value
    assert mem.bytes == 10 + 10 + 2
    now[0] = 5.0
    mem.get("c")  # a get refreshes the TTL
    now[0] = 12.0
    assert not mem.has("a") and not mem.has("d") and mem.has("c")
    assert mem.stats.ttl_evictions == 2 and mem.bytes == 10
    assert not mem.put("huge", b"x" * 40) and mem.stats.rejected == 1


def test_concurrent_clients_get_their_own_bytes(store):
    errors = []

    def worker(n: int) -> None:
        c = StoreClient(store.endpoint, SECRET, timeout_s=30)
        try:
            for i in range(40):
                value = os.urandom(10_000 + 997 * n + i)
                key = f"worker{n}/{i}"
                if i % 2:
                    c.put(key, value)
                else:
                    c.put_many([(key, value)])
                if c.get(key) != value or bytes(c.get_many([key])[0]) != value:
                    errors.append(key)
        finally:
            c.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_killed_store_is_tolerated(tmp_path):
    alive = StoreProcess(secret_file(tmp_path))
    dead = StoreProcess(secret_file(tmp_path))
    clients = [StoreClient(s.endpoint, SECRET, timeout_s=5) for s in (alive, dead)]
    try:
        for c in clients:
            assert c.put("shard", b"bytes")
        dead.kill()
        with pytest.raises(StoreUnavailable, match="ConnectError"):
            clients[1].get("shard")  # refused: fails at once, no retry needed
        got = []
        with ThreadPoolExecutor(4) as pool:
            failed = gather_until(pool, [lambda c=c: c.get("shard") for c in clients], got.append, 10)
        assert got == [b"bytes"] and failed == 1
    finally:
        for c in clients:
            c.close()
        alive.kill()


def test_malformed_requests_are_rejected(store, client):
    assert httpx.post(store.endpoint + "/v1/batch/get", content=b"\x05\x00ab",
                      headers={"authorization": f"Bearer {SECRET}"}).status_code == 400
    assert httpx.post(store.endpoint + "/v1/batch/frobnicate", content=b"",
                      headers={"authorization": f"Bearer {SECRET}"}).status_code == 404
    host, port = urlsplit(store.endpoint).hostname, urlsplit(store.endpoint).port
    auth = f"authorization: Bearer {SECRET}\r\n".encode()
    for head, status in [(b"PUT /v1/shards/x HTTP/1.1\r\n" + auth + b"content-length: 99999999999\r\n\r\n", b"413"),
                         (b"PUT /v1/shards/x HTTP/1.1\r\ncontent-length: 99999999999\r\n\r\n", b"401"),
                         (b"PUT /v1/shards/x HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n", b"411"),
                         (b"garbage\r\n\r\n", b"400")]:
        with socket.create_connection((host, port), timeout=10) as raw:
            raw.sendall(head)
            assert raw.recv(100).split(b" ")[1] == status
    assert client.put("still", b"serving")


def test_agent_stops_cleanly_on_sigterm(tmp_path):
    store = StoreProcess(secret_file(tmp_path))
    assert store.stop() == 0
    assert any("stopped" in line for line in store.lines)


def test_agent_rejects_a_missing_secret_file(tmp_path):
    out = subprocess.run([agent_python(), "-m", "orchestrator.replica.agent", "--store-port", "0",
                          "--secret-file", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--secret-file" in out.stderr and "Traceback" not in out.stderr


def test_agent_module_imports_nothing_from_the_control_plane():
    code = ("import sys, orchestrator.replica.agent, orchestrator.replica.kv.pool; "
            "bad = [m for m in ('sqlmodel', 'typer', 'boto3', 'sky', 'fastapi') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_agent_runs_its_duties_beside_the_store():
    import asyncio

    from orchestrator.replica.agent import AgentOptions, serve

    events: list[str] = []

    class Probe:  # the shape of a duty (orchestrator.replica.watchers.WatchLoop): start() and stop()
        def start(self):
            events.append("start")

        def stop(self):
            events.append("stop")

    async def scenario(port: int) -> None:  # on plain asyncio here, not uvloop: both must serve
        stop = asyncio.Event()
        server = asyncio.create_task(serve(AgentOptions(store_port=port, secret="s"), duties=[Probe()], stop=stop))
        client = StoreClient(f"http://127.0.0.1:{port}", "s", timeout_s=10)
        for _ in range(100):
            try:
                stored = await asyncio.to_thread(client.put, "k", b"v" * 100_000)
                break
            except StoreUnavailable:  # not listening yet
                await asyncio.sleep(0.1)
        assert stored and await asyncio.to_thread(client.get, "k") == b"v" * 100_000
        client.close()
        stop.set()
        await server

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    asyncio.run(scenario(free))
    assert events == ["start", "stop"]


def test_store_benchmark_runs_and_reports_its_ratio():
    import json

    script = BENCHMARKS / "bench_store.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "BENCH_STORE_MIB": "16"}, check=True)
    assert json.loads(out.stdout)["ratio_vs_socket"] > 0


def test_a_refused_upload_gets_its_401_and_the_connection_stays_usable(store):
    body = os.urandom(4 << 20)  # larger than socket buffers: read past, not buffered
    with httpx.Client(base_url=store.endpoint, timeout=30) as http:
        assert http.put("/v1/shards/x", content=body).status_code == 401
        good = {"authorization": f"Bearer {SECRET}"}
        assert http.put("/v1/shards/x", content=body, headers=good).status_code == 204
        assert http.get("/v1/shards/x", headers=good).content == body


def test_agent_reports_a_taken_port_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([agent_python(), "-m", "orchestrator.replica.agent", "--store-port", str(port),
                              "--secret-file", str(secret_file(tmp_path))], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "cannot serve the shard store" in out.stderr and "Traceback" not in out.stderr


def test_a_restarted_store_is_reached_again_over_a_fresh_connection(tmp_path):
    first = StoreProcess(secret_file(tmp_path))
    port = urlsplit(first.endpoint).port
    c = StoreClient(first.endpoint, SECRET, timeout_s=10)
    try:
        assert c.put("k", b"v")  # leaves a keep-alive connection in the client's pool
        first.kill()
        second = StoreProcess(secret_file(tmp_path), port=port)
        try:
            assert c.get("k") is None  # the dead pooled connection is replaced, not an error
            assert c.put("k", b"w") and c.get("k") == b"w"
        finally:
            second.kill()
    finally:
        c.close()
        first.kill()
