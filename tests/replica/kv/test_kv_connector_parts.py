"""The connector's vLLM-free parts: its config, the background saver over real shard stores,
the flush/stats control endpoint and the membership poll, all over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from orchestrator.common.errors import UserError
from orchestrator.replica.kv.control import ControlServer
from orchestrator.replica.kv.membership import Membership
from orchestrator.replica.kv.placement import StoreNode
from orchestrator.replica.kv.pool import ErasureCodedPool
from orchestrator.replica.kv.saver import BlockSaver, StagedBlocks
from orchestrator.replica.kv.settings import parse_settings, transfer_config
from orchestrator.replica.kv.stats import KVStats
from tests.helpers import free_port
from tests.fakes.vllm_procs import Processes, start_store

SECRET = "parts-secret"
STORE = {"node_id": "s1", "endpoint": "http://127.0.0.1:9", "cloud": "local", "region": "r1", "zone": "z1"}


def test_settings_accept_a_launcher_config(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    settings = parse_settings({"stores": [STORE], "secret_file": str(secret_file), "k": 2, "m": 1,
                               "control_port": "8702"})  # templates substitute ports as strings
    assert settings.secret == SECRET and settings.control_port == 8702
    assert settings.stores[0].zone == "z1" and (settings.k, settings.m) == (2, 1)
    own = parse_settings({"secret": SECRET, "node_id": "r1", "self_endpoint": "http://127.0.0.1:5",
                          "cloud": "local", "region": "r1", "zone": "z2"})
    assert own.self_store == StoreNode("r1", "http://127.0.0.1:5", "local", "r1", "z2")
    assert own.repair_bytes_per_s == 200e6  # the default limit
    unlimited = parse_settings({"stores": [STORE], "secret": SECRET, "repair_mb_per_s": 0})
    assert unlimited.repair_bytes_per_s is None
    assert parse_settings({"stores": [STORE], "secret": SECRET, "repair_mb_per_s": None}).repair_bytes_per_s is None
    config = transfer_config({"secret": SECRET})
    assert config["kv_connector"] == "SpotKVConnector"
    assert config["kv_connector_module_path"] == "orchestrator.replica.kv.connector"


@pytest.mark.parametrize("extra, field", [
    ({"stores": [STORE]}, "secret"),
    ({"stores": [STORE], "secret": SECRET, "colour": 1}, "colour"),
    ({"stores": [STORE], "secret": SECRET, "control_port": "{control_port}"}, "control_port"),
    ({"stores": [STORE], "secret": SECRET, "k": 0}, "k"),
    ({"secret": SECRET}, "no shard stores"),
    ({"stores": [STORE], "secret": SECRET, "repair_mb_per_s": -1}, "repair_mb_per_s"),
    ({"secret": SECRET, "node_id": "r1"}, "self_endpoint"),
    ({"stores": [{**STORE, "endpoint": "ftp://x"}], "secret": SECRET}, "endpoint"),
    ({"stores": [STORE], "secret_file": "/nonexistent/secret"}, "secret_file"),
])
def test_bad_settings_name_the_field(extra, field):
    with pytest.raises(UserError, match=field) as err:
        parse_settings(extra)
    assert "\n" not in str(err.value)


@pytest.fixture
def stores(tmp_path):
    """Three real shard stores (agent processes) in three zones."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    procs = Processes(sys.executable, tmp_path)
    try:
        yield procs, [StoreNode(f"s{i}", start_store(procs, f"s{i}", secret_file), "local", "r1", f"z{i}")
                      for i in range(3)]
    finally:
        procs.kill_all()


def _staged(keys: list[str], size: int = 4096) -> StagedBlocks:
    rows = np.random.default_rng(len(keys)).integers(0, 256, (len(keys), size), dtype=np.uint8)
    return StagedBlocks(keys, rows)


def test_saver_pushes_in_the_background_and_flush_waits_for_it(stores):
    procs, nodes = stores
    stats = KVStats()
    with ErasureCodedPool(nodes, SECRET, k=2, m=1) as pool:
        saver = BlockSaver(pool, stats, batch_blocks=3)
        staged = _staged([f"block-{i}" for i in range(10)])
        assert saver.submit(staged)
        assert saver.flush(timeout_s=60)
        assert saver.pending_blocks() == 0
        assert pool.get_many(staged.keys) == [bytearray(row) for row in staged.rows]
        # Blocks already in the pool (another replica stored the same prefix) are not re-sent.
        saver.submit(_staged(staged.keys[:4]))
        assert saver.flush(timeout_s=60)
        counts = stats.snapshot()
        assert counts["blocks_saved"] == 10 and counts["blocks_already_stored"] == 4

        # Stores gone: saves fail quietly (counted), flush still returns, nothing raises.
        procs.kill_all()
        saver.submit(_staged(["late-0", "late-1"]))
        assert saver.flush(timeout_s=60)
        assert stats.snapshot()["blocks_save_failed"] == 2
        assert "late-0" not in saver.known  # a later step may try again
        saver.close()


def test_a_full_save_queue_drops_blocks_instead_of_blocking(stores):
    _, nodes = stores
    stats = KVStats()
    with ErasureCodedPool(nodes, SECRET, k=2, m=1) as pool:
        saver = BlockSaver(pool, stats, max_pending_bytes=4096)
        assert not saver.submit(_staged(["too-big-0", "too-big-1"]))
        assert stats.snapshot()["blocks_dropped"] == 2
        saver.close()


def test_control_endpoint_needs_the_secret_and_flushes(stores):
    _, nodes = stores
    stats = KVStats()
    with ErasureCodedPool(nodes, SECRET, k=2, m=1) as pool:
        saver = BlockSaver(pool, stats)
        server = ControlServer("127.0.0.1", 0, SECRET, flush=saver.flush, pending=saver.pending_blocks,
                               stats=lambda: stats.snapshot(pending_blocks=saver.pending_blocks()))
        auth = {"Authorization": f"Bearer {SECRET}"}
        try:
            assert httpx.post(f"{server.address}/v1/flush").status_code == 401
            assert httpx.get(f"{server.address}/v1/stats", headers={"Authorization": "Bearer nope"}).status_code == 401
            assert httpx.post(f"{server.address}/v1/flush?timeout_s=soon", headers=auth).status_code == 400
            assert httpx.get(f"{server.address}/v1/other", headers=auth).status_code == 404
            saver.submit(_staged([f"c-{i}" for i in range(5)]))
            reply = httpx.post(f"{server.address}/v1/flush", headers=auth, timeout=60)
            assert reply.status_code == 200 and reply.json()["flushed"] and reply.json()["pending_blocks"] == 0
            assert pool.has_many([f"c-{i}" for i in range(5)]) == [True] * 5
            body = httpx.get(f"{server.address}/v1/stats", headers=auth).json()
            assert body["blocks_saved"] == 5 and body["flushes"] == 1
        finally:
            server.close()
            saver.close()


def test_flush_answers_504_when_it_cannot_finish_in_time():
    server = ControlServer("127.0.0.1", 0, SECRET, flush=lambda timeout_s: False, pending=lambda: 7,
                           stats=dict)
    try:
        reply = httpx.post(f"{server.address}/v1/flush?timeout_s=0.1", headers={"Authorization": f"Bearer {SECRET}"})
        body = reply.json()
        assert reply.status_code == 504 and body["flushed"] is False and body["pending_blocks"] == 7
    finally:
        server.close()


class _Daemon:
    """The daemon's /v1/services/NAME/stores route: a list the test changes."""

    def __init__(self):
        self.stores = [STORE]
        self.seen_auth: list[str] = []
        daemon = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                daemon.seen_auth.append(self.headers.get("Authorization", ""))
                body = json.dumps({"stores": daemon.stores}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/services/svc/stores"


def test_membership_follows_the_daemon_and_keeps_the_last_list_when_it_is_gone():
    daemon = _Daemon()
    settings = parse_settings({"membership_url": daemon.url, "secret": SECRET, "membership_poll_s": 0.1,
                               "node_id": "me", "self_endpoint": "http://127.0.0.1:7", "cloud": "local",
                               "region": "r1", "zone": "z9"})
    membership = Membership(settings)
    assert [n.node_id for n in membership.nodes] == ["me", "s1"]
    changes: list[list[str]] = []
    membership.watch(lambda nodes: changes.append([n.node_id for n in nodes]))
    daemon.stores = [STORE, {**STORE, "node_id": "s2", "zone": "z2"}]
    deadline = time.monotonic() + 30
    while not changes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert changes == [["me", "s1", "s2"]]
    assert set(daemon.seen_auth) == {f"Bearer {SECRET}"}
    daemon.server.shutdown()
    daemon.server.server_close()
    time.sleep(0.5)  # a few failed polls
    assert [n.node_id for n in membership.nodes] == ["me", "s1", "s2"] and len(changes) == 1
    membership.close()


STAGING_ROUND_TRIP = """
import torch
from orchestrator.replica.kv.staging import PagedLayout

for ratio in (1, 2):  # 2: the attention kernel splits each scheduler block in two
    num_blocks = 6
    layers = [torch.randn(num_blocks * ratio, 2, 4, 8) for _ in range(3)]
    staged = PagedLayout(layers, num_blocks).gather([1, 4], ["k1", "k4"])
    fresh = [torch.zeros_like(layer) for layer in layers]
    target = PagedLayout(fresh, num_blocks)
    rows = target.host_rows(2)
    rows[:] = staged.rows  # what a load decodes into them
    target.scatter_rows([5, 0], rows)
    for src, dst in zip(layers, fresh):
        for s, d in ((1, 5), (4, 0)):
            assert torch.equal(src[s * ratio:(s + 1) * ratio], dst[d * ratio:(d + 1) * ratio]), (ratio, s, d)
        assert not any(dst[b * ratio:(b + 1) * ratio].any() for b in (1, 2, 3, 4)), ratio
print("staged")
"""


def test_blocks_gathered_from_one_paged_cache_scatter_into_another(replica_runtime):
    # The connector's copies between vLLM's paged KV cache and host rows (CPU tensors, the
    # layout vLLM's CPU build hands the connector); torch lives in the replica runtime only.
    out = subprocess.run([str(replica_runtime), "-c", STAGING_ROUND_TRIP], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "staged", out.stderr[-2000:]
