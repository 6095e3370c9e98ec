"""End to end: real vLLM (CPU build) with the erasure-coded KV connector and real shard stores.

Replica A serves two long prompts; every full block lands as k=4 + m=2 shards on 6 stores
in 3 zones. A and both stores of one zone are killed. A fresh replica B, given a prompt
plus the tokens A produced, loads the prefix from the 4 surviving stores, recomputes less
than one block and continues token for token like A's uninterrupted run. Then one of the
survivors starts returning corrupt shards: B loads what still decodes, vLLM recomputes the
rest, and the continuation is still exact.
"""

from __future__ import annotations

import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from orchestrator.replica.kv import wire
from orchestrator.replica.kv.settings import transfer_config
from tests.helpers import free_port
from tests.fakes.vllm_procs import Processes, greedy_token_ids, start_store, start_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 32
ZONES = {"s1": "zone-a", "s2": "zone-a", "s3": "zone-b", "s4": "zone-b", "s5": "zone-c", "s6": "zone-c"}
GENERATED = 100


class FaultyStoreProxy:
    """A shard store's front door that can start corrupting the shards it returns.

    Once `corrupt_from` is set, every batch get answer has one byte flipped in each value at
    that position or later (the pool asks for a store's shards in block order, so the later
    blocks of a prefix go bad: a failing disk, as far as the client can tell).
    """

    def __init__(self, upstream: str, secret: str):
        self.corrupt_from: int | None = None
        self.delay_s = 0.0  # answer late: a slow store (the connector must not stall vLLM on it)
        proxy = self
        client = httpx.Client(base_url=upstream, timeout=30, headers={"Authorization": f"Bearer {secret}"})

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                time.sleep(proxy.delay_s)
                upstream_reply = client.request(self.command, self.path, content=body)
                data = upstream_reply.content
                if proxy.corrupt_from is not None and self.path == "/v1/batch/get" and upstream_reply.is_success:
                    keys = wire.decode_keys(body)
                    values = [None if v is None else bytearray(v) for v in wire.decode_values(data, len(keys))]
                    for value in values[proxy.corrupt_from:]:
                        if value:
                            value[len(value) // 2] ^= 0xFF
                    data = b"".join(wire.encode_values(values))
                self.send_response(upstream_reply.status_code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _forward

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self._client = client

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()


def kv_transfer_config(stores: list[dict], secret_file: Path, control_port: int) -> dict:
    return transfer_config({"stores": stores, "secret_file": str(secret_file), "k": 4, "m": 2, "timeout_s": 2.0,
                            "control_port": control_port})


def shards_held(endpoint: str, auth: dict) -> int:
    metrics = httpx.get(f"{endpoint}/metrics", headers=auth, timeout=10).text
    return int(float(re.search(r"^spot_kv_store_items (\S+)$", metrics, re.M).group(1)))


def last_request(control: str, auth: dict) -> dict:
    stats = httpx.get(f"{control}/v1/stats", headers=auth, timeout=10).json()
    return stats["recent_requests"][-1]


def test_prefix_survives_a_zone_loss_and_continues_token_exact(replica_runtime, tiny_model, tmp_path):
    secret = "kv-test-secret"
    secret_file = tmp_path / "kv.secret"
    secret_file.write_text(secret)
    auth = {"Authorization": f"Bearer {secret}"}
    rng = random.Random(5)
    prompt1 = [rng.randrange(7, 512) for _ in range(200)]
    prompt2 = [rng.randrange(7, 512) for _ in range(170)]
    procs = Processes(replica_runtime, tmp_path)
    proxy = None
    try:
        endpoints = {name: start_store(procs, name, secret_file) for name in ZONES}
        proxy = FaultyStoreProxy(endpoints["s3"], secret)
        stores = [{"node_id": name, "endpoint": proxy.endpoint if name == "s3" else endpoints[name],
                   "cloud": "local", "region": "local-1", "zone": zone} for name, zone in ZONES.items()]

        # Replica A: the uninterrupted runs, saved block by block as they are computed.
        control_a = f"http://127.0.0.1:{(port_a := free_port())}"
        a = start_vllm(procs, "replica-a", tiny_model, kv_config=kv_transfer_config(stores, secret_file, port_a))
        reference1 = greedy_token_ids(a, tiny_model, prompt1, GENERATED)
        reference2 = greedy_token_ids(a, tiny_model, prompt2, GENERATED)
        assert httpx.post(f"{control_a}/v1/flush", timeout=30).status_code == 401  # needs the secret
        flushed = httpx.post(f"{control_a}/v1/flush", headers=auth, timeout=120)
        assert flushed.status_code == 200 and flushed.json()["flushed"], flushed.text
        stats_a = httpx.get(f"{control_a}/v1/stats", headers=auth, timeout=10).json()
        # KV exists for every token but the last generated one: its full blocks were saved.
        expected_blocks = sum((len(p) + GENERATED - 1) // BLOCK for p in (prompt1, prompt2))
        assert stats_a["blocks_saved"] == expected_blocks, stats_a
        assert stats_a["blocks_save_failed"] == stats_a["blocks_dropped"] == 0, stats_a
        # k + m = 6 stores: each holds exactly one shard of every block.
        assert [shards_held(e, auth) for e in endpoints.values()] == [expected_blocks] * 6

        # A is preempted, and a whole zone (s1, s2: two shards of every block) goes with it.
        for name in ("replica-a", "s1", "s2"):
            procs.kill(name)

        control_b = f"http://127.0.0.1:{(port_b := free_port())}"
        b = start_vllm(procs, "replica-b", tiny_model, kv_config=kv_transfer_config(stores, secret_file, port_b))

        # A had streamed `cut` tokens: B continues from prompt + those tokens. The one store
        # whose shards B needs (4 left = k) is slow: the lookup outlasts several scheduler steps.
        cut = 8 * BLOCK + 13 - len(prompt1)
        proxy.delay_s = 0.5
        continued = greedy_token_ids(b, tiny_model, prompt1 + reference1[:cut], GENERATED - cut)
        proxy.delay_s = 0.0
        assert continued == reference1[cut:]
        record = last_request(control_b, auth)
        assert record["loaded_tokens"] == 8 * BLOCK, record
        assert record["recomputed_tokens"] == 13 <= BLOCK, record
        assert f"external cache hit: {8 * BLOCK} tokens" in procs.log("replica-b")

        # One surviving store now corrupts shards: blocks 3.. of the next prefix keep only
        # 3 valid shards (< k). B must load blocks 0-2 and recompute the rest, still exactly.
        proxy.corrupt_from = 3
        cut = 7 * BLOCK + 5 - len(prompt2)
        continued = greedy_token_ids(b, tiny_model, prompt2 + reference2[:cut], GENERATED - cut)
        assert continued == reference2[cut:]
        record = last_request(control_b, auth)
        assert record["failed_blocks"] == 4 and record["loaded_tokens"] == 3 * BLOCK, record
        assert "unrecoverable, vLLM recomputes them" in procs.log("replica-b")
    finally:
        procs.kill_all()
        if proxy is not None:
            proxy.close()
