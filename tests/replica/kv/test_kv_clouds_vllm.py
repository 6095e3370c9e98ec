"""End to end across clouds: real vLLM (CPU build) with the KV connector, `failure_domain: cloud`.

Six real shard stores stand for three clouds (two each), every one serving TLS on its port with a
certificate from the service's CA. Replica A, homed in the first cloud, saves each full block as
two shards per cloud: the shards bound for the other clouds go over TLS, and its stats price
them. A and its whole cloud (both stores) are lost; replica B, homed in the second cloud, loads
the prefix from the two clouds left, over TLS for the third, and continues token for token.
"""

from __future__ import annotations

import random

import httpx
import pytest

from orchestrator.common.kvtls import CA_FILE
from orchestrator.replica.kv.settings import transfer_config
from tests.fakes.kv_stores import store_tls_dir
from tests.fakes.vllm_procs import Processes, greedy_token_ids, start_store, start_vllm
from tests.helpers import free_port
from tests.replica.kv.test_kv_connector_vllm import BLOCK, last_request, shards_held

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

STORES = {"a1": "alpha", "a2": "alpha", "b1": "beta", "b2": "beta", "g1": "gamma", "g2": "gamma"}
EGRESS = {"alpha": {"out_of_cloud": 0.09, "inter_region": 0.02},
          "beta": {"out_of_cloud": 0.12, "inter_region": 0.02},
          "gamma": {"out_of_cloud": 0.087, "inter_region": 0.02}}
GENERATED = 60


def test_a_cloud_domain_spreads_over_tls_prices_its_egress_and_survives_a_cloud(replica_runtime, tiny_model,
                                                                                tmp_path, monkeypatch):
    monkeypatch.setenv("SPOT_ORCHESTRATOR_HOME", str(tmp_path / "state"))  # where the service's CA is kept
    secret = "kv-test-secret"
    secret_file = tmp_path / "kv.secret"
    secret_file.write_text(secret)
    auth = {"Authorization": f"Bearer {secret}"}
    prompt = [random.Random(7).randrange(7, 512) for _ in range(230)]
    procs = Processes(replica_runtime, tmp_path)
    try:
        tls = {name: store_tls_dir(tmp_path / "tls", "chat", name) for name in STORES}
        endpoints = {name: start_store(procs, name, secret_file, ["--tls-dir", str(tls[name])]) for name in STORES}
        stores = {name: {"node_id": name, "endpoint": endpoints[name], "cloud": cloud, "region": f"{cloud}-1",
                         "zone": f"{cloud}-1a"} for name, cloud in STORES.items()}

        def config(home: str, control_port: int) -> dict:
            own = stores[home]
            return transfer_config({
                "stores": [s for name, s in stores.items() if name != home], "node_id": home,
                "self_endpoint": own["endpoint"], "cloud": own["cloud"], "region": own["region"],
                "zone": own["zone"], "secret_file": str(secret_file), "k": 4, "m": 2, "timeout_s": 5.0,
                "control_port": control_port, "failure_domain": "cloud",
                "tls_ca_file": str(tls[home] / CA_FILE), "egress": EGRESS})

        control_a = f"http://127.0.0.1:{(port_a := free_port())}"
        a = start_vllm(procs, "replica-a", tiny_model, kv_config=config("a1", port_a))
        reference = greedy_token_ids(a, tiny_model, prompt, GENERATED)
        flushed = httpx.post(f"{control_a}/v1/flush", headers=auth, timeout=120)
        assert flushed.status_code == 200 and flushed.json()["flushed"], flushed.text
        stats_a = httpx.get(f"{control_a}/v1/stats", headers=auth, timeout=10).json()
        blocks = (len(prompt) + GENERATED - 1) // BLOCK
        assert stats_a["blocks_saved"] == blocks and stats_a["blocks_save_failed"] == 0, stats_a
        # two shards of every block per cloud, one per store
        assert [shards_held(endpoints[name], auth) for name in STORES] == [blocks] * 6
        egress = stats_a["egress"]
        for cloud in ("beta", "gamma"):  # 2 of 6 shards of every block went to each, over TLS
            assert egress[cloud]["bytes"] >= stats_a["bytes_saved"] / 4 * 2 * 0.95, egress
            assert egress[cloud]["usd"] == pytest.approx(egress[cloud]["bytes"] / 1e9 * 0.09)
        assert egress.get("alpha", {"bytes": 0})["bytes"] < 0.01 * stats_a["bytes_saved"]  # only the answers

        for name in ("replica-a", "a1", "a2"):  # A's whole cloud goes
            procs.kill(name)

        control_b = f"http://127.0.0.1:{(port_b := free_port())}"
        b = start_vllm(procs, "replica-b", tiny_model, kv_config=config("b1", port_b))
        cut = 8 * BLOCK + 11 - len(prompt)
        continued = greedy_token_ids(b, tiny_model, prompt + reference[:cut], GENERATED - cut)
        assert continued == reference[cut:]
        record = last_request(control_b, auth)
        assert record["loaded_tokens"] == 8 * BLOCK and record["failed_blocks"] == 0, record
        egress_b = httpx.get(f"{control_b}/v1/stats", headers=auth, timeout=10).json()["egress"]
        assert egress_b["beta"]["bytes"] > 0  # gamma's shards delivered into beta, at gamma's rate
        assert egress_b["beta"]["usd"] == pytest.approx(egress_b["beta"]["bytes"] / 1e9 * 0.087, rel=0.05)
    finally:
        procs.kill_all()
