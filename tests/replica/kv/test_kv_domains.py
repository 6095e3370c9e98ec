"""Failure domains, TLS between clouds and egress, over real shard stores on real HTTP(S).

Nine agents stand for three clouds (one region, three zones each), every one serving TLS on its
port with a certificate from the service's CA, as the daemon issues them.
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.common.errors import UserError
from orchestrator.common.kvtls import CA_FILE, store_server_name
from orchestrator.replica.kv.egress import EgressMeter, EgressPrices
from orchestrator.replica.kv.placement import (
    FAILURE_DOMAINS,
    Placement,
    PlacementError,
    StoreNode,
    domain_bound_feasible,
    domain_of,
    place,
    scope_of,
)
from orchestrator.replica.kv.pool import ErasureCodedPool, shard_key
from orchestrator.replica.kv.settings import parse_settings
from orchestrator.replica.kv.store import StoreClient, StoreUnavailable
from orchestrator.replica.kv.transport import PeerTLS, client_tls_context
from tests.fakes.kv_stores import SECRET, StoreProcess, secret_file, store_tls_dir

CLOUDS = ("alpha", "beta", "gamma")
PRICES = EgressPrices({"alpha": {"out_of_cloud": 0.09, "inter_region": 0.02},
                       "beta": {"out_of_cloud": 0.12, "inter_region": 0.02},
                       "gamma": {"out_of_cloud": 0.087, "inter_region": 0.02}})
SERVICE = "chat"


def topology(shape: list[list[int]]) -> list[StoreNode]:
    """shape[cloud][region] = zones in that region, one store per zone."""
    return [StoreNode(f"c{c}-r{r}-z{z}", f"http://c{c}-r{r}-z{z}:1", f"c{c}", f"c{c}-r{r}", f"c{c}-r{r}-z{z}")
            for c, regions in enumerate(shape) for r, zones in enumerate(regions) for z in range(zones)]


# -- placement ---------------------------------------------------------------------------


def test_each_domain_is_kept_to_m_shards_within_the_cheapest_scope():
    nodes = topology([[3, 1, 1], [3], [3]])  # cloud 0: a region of 3 zones and two of 1
    home = nodes[0]  # c0-r0
    zone = place("key", nodes, 4, 2, domain="zone", home=home)
    assert {n.region for n in zone} == {"c0-r0"}  # the home region alone gives zone survivability
    assert max(Counter(n.zone for n in zone).values()) <= 2
    lone = next(n for n in nodes if n.region == "c0-r1")  # a region of one zone: widen to its cloud
    wider = place("key", nodes, 4, 2, domain="zone", home=lone)
    assert {n.cloud for n in wider} == {"c0"} and len({n.region for n in wider}) > 1
    region = place("key", nodes, 4, 2, domain="region", home=home)
    assert {n.cloud for n in region} == {"c0"} and max(Counter(n.region for n in region).values()) <= 2
    cloud = place("key", nodes, 4, 2, domain="cloud", home=home)
    assert Counter(n.cloud for n in cloud) == {"c0": 2, "c1": 2, "c2": 2}


def test_a_cloud_domain_the_fleet_cannot_give_is_refused_strictly_and_placed_best_effort():
    nodes = topology([[3], [3]])  # two clouds: a third of the shards would have to double up
    with pytest.raises(PlacementError, match=r"2 cloud\(s\) cannot hold 4\+2 shards.*need at least 3 clouds"):
        place("key", nodes, 4, 2, domain="cloud")
    assert len(place("key", nodes, 4, 2, domain="cloud", strict=False)) == 6
    # zone and region never leave the home cloud, even when that cloud cannot give them
    thin = topology([[1], [3]])
    spread = place("key", thin, 4, 2, domain="zone", home=thin[0], strict=False)
    assert {n.cloud for n in spread} == {"c0"}
    with pytest.raises(PlacementError, match="unknown failure domain 'planet'"):
        Placement(thin, 4, 2, domain="planet")


shapes = st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(shapes, st.sampled_from(FAILURE_DOMAINS), st.integers(1, 6), st.integers(1, 3), st.data())
def test_random_topologies_keep_the_scope_and_the_domain_bound(shape, domain, k, m, data):
    nodes = topology(shape)
    home = data.draw(st.sampled_from(nodes))
    scope = scope_of(nodes, k, m, domain, home)
    holders = place("some-key", nodes, k, m, domain=domain, home=home, strict=False)
    assert set(holders) <= set(scope) and len(holders) == k + m
    if domain != "cloud":
        assert {n.cloud for n in scope} == {home.cloud}  # shards leave a cloud only for `cloud`
    if domain == "zone" and domain_bound_feasible([n for n in nodes if n.region == home.region], k, m, domain):
        assert {n.region for n in scope} == {home.region}  # the narrowest scope that suffices
    if domain_bound_feasible(scope, k, m, domain):
        assert max(Counter(domain_of(n, domain) for n in holders).values()) <= m
        for lost in {domain_of(n, domain) for n in scope}:  # any one domain lost leaves k
            assert sum(domain_of(n, domain) != lost for n in holders) >= k


# -- prices and settings -----------------------------------------------------------------


def test_egress_is_priced_at_the_sending_clouds_rate_and_only_when_it_leaves_a_region():
    a1 = StoreNode("a1", "http://a1:1", "alpha", "alpha-1", "alpha-1a")
    a1b = StoreNode("a1b", "http://a1b:1", "alpha", "alpha-1", "alpha-1b")
    a2 = StoreNode("a2", "http://a2:1", "alpha", "alpha-2", "alpha-2a")
    b1 = StoreNode("b1", "http://b1:1", "beta", "beta-1", "beta-1a")
    assert PRICES.per_gb(a1, a1b) is None
    assert PRICES.per_gb(a1, a2) == 0.02 and PRICES.per_gb(a1, b1) == 0.09 and PRICES.per_gb(b1, a1) == 0.12
    meter = EgressMeter(PRICES, a1)
    meter.count(a1b, 10**9, 10**9)  # same region: not egress
    meter.count(b1, 2 * 10**9, 10**9)  # 2 GB out to beta at alpha's rate, 1 GB back at beta's
    assert meter.snapshot() == {"beta": {"bytes": 2 * 10**9, "usd": pytest.approx(0.18)},
                                "alpha": {"bytes": 10**9, "usd": pytest.approx(0.12)}}


@pytest.mark.parametrize(("extra", "message"), [
    ({"failure_domain": "rack"}, "failure_domain: expected one of zone, region, cloud, got 'rack'"),
    ({"egress": {"alpha": {"out_of_cloud": -1}}}, "egress.alpha.out_of_cloud: expected a price >= 0"),
    ({"egress": {"alpha": {"per_gb": 1}}}, "egress.alpha: expected an object with out_of_cloud, inter_region"),
    ({"tls_ca_file": "/nonexistent/ca.crt"}, "tls_ca_file: not a readable file"),
])
def test_bad_kv_settings_are_one_line_errors(extra, message):
    base = {"secret": "s", "stores": [{"node_id": "a", "endpoint": "http://a:1", "cloud": "alpha",
                                       "region": "r", "zone": "z"}]}
    with pytest.raises(UserError, match="kv_connector_extra_config." + message.replace("(", r"\(")) as err:
        parse_settings({**base, **extra})
    assert "\n" not in str(err.value)


# -- real stores ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Nine TLS-capable stores: {node_id: (StoreNode, StoreProcess)} and the service CA's file."""
    root = tmp_path_factory.mktemp("fleet")
    procs: dict[str, tuple[StoreNode, StoreProcess]] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPOT_ORCHESTRATOR_HOME", str(root / "state"))
        secret = secret_file(root)
        try:
            for cloud in CLOUDS:
                for zone in "abc":
                    node_id = f"{cloud}-{zone}"
                    tls = store_tls_dir(root / "tls", SERVICE, node_id)
                    proc = StoreProcess(secret, max_bytes=64 << 20, extra=["--tls-dir", str(tls)])
                    procs[node_id] = (StoreNode(node_id, proc.endpoint, cloud, f"{cloud}-1", f"{cloud}-1{zone}"), proc)
            other = store_tls_dir(root / "tls", "another-service", "alpha-a")  # a CA the fleet does not use
            yield procs, tls / CA_FILE, other / CA_FILE
        finally:
            for _, proc in procs.values():
                proc.kill()


def open_pool(fleet, home_id: str, domain: str, with_ca: bool = True) -> tuple[ErasureCodedPool, EgressMeter]:
    procs, ca, _ = fleet
    nodes = [node for node, _ in procs.values()]
    meter = EgressMeter(PRICES, procs[home_id][0])
    pool = ErasureCodedPool(nodes, SECRET, k=4, m=2, timeout_s=5.0, domain=domain, home=procs[home_id][0],
                            tls_context=client_tls_context(str(ca)) if with_ca else None, meter=meter)
    return pool, meter


def stored_at(fleet, key: str) -> dict[str, int]:
    """node_id -> how many of the key's 6 shards that store holds (asked over plain HTTP)."""
    out = {}
    for node_id, (node, _) in fleet[0].items():
        client = StoreClient(node.endpoint, SECRET)
        out[node_id] = sum(client.has_many([shard_key(key, i) for i in range(6)]))
        client.close()
    return out


def test_zone_domain_keeps_a_blocks_shards_in_the_writers_region_with_no_egress(fleet):
    pool, meter = open_pool(fleet, "alpha-a", "zone")
    data = {f"zone-key-{i}": os.urandom(20_000 + i) for i in range(8)}
    with pool:
        pool.put_many(list(data.items()))
        assert pool.get_many(list(data)) == list(data.values())
    for key in data:
        held = stored_at(fleet, key)
        assert sum(held.values()) == 6 and all(held[n] == 2 for n in ("alpha-a", "alpha-b", "alpha-c"))
    assert meter.snapshot() == {}  # nothing left alpha's region


def test_a_reader_in_another_cloud_loads_over_tls_and_its_egress_is_counted(fleet):
    writer, _ = open_pool(fleet, "alpha-a", "zone")
    data = {f"migrated-{i}": os.urandom(30_000) for i in range(4)}
    with writer:
        writer.put_many(list(data.items()))
    reader, meter = open_pool(fleet, "beta-b", "zone")  # a continuation that landed in beta
    with reader:
        assert reader.has_many(list(data)) == [True] * 4
        assert reader.get_many(list(data)) == list(data.values())
    egress = meter.snapshot()
    # alpha's shards delivered into beta, priced at alpha's rate; out of beta went only the
    # requests (shard keys) to the other clouds' holders
    assert egress["beta"]["bytes"] >= 4 * 30_000
    assert set(egress) <= {"alpha", "beta", "gamma"} and egress["alpha"]["bytes"] < 10_000
    # (a few bytes of it are gamma's empty answers, at gamma's rate)
    assert egress["beta"]["usd"] == pytest.approx(egress["beta"]["bytes"] / 1e9 * 0.09, rel=1e-2)


def test_cloud_domain_puts_at_most_m_shards_per_cloud_survives_a_cloud_and_counts_its_egress(fleet):
    pool, meter = open_pool(fleet, "alpha-a", "cloud")
    data = {f"cloud-key-{i}": os.urandom(40_000) for i in range(6)}
    with pool:
        pool.put_many(list(data.items()))
        for key in data:
            assert Counter(n.cloud for n in pool.holders(key)) == {"alpha": 2, "beta": 2, "gamma": 2}
        sent = meter.snapshot()
        # only what crossed clouds (alpha's own share is free); back into alpha came the flags
        assert set(sent) == {"alpha", "beta", "gamma"} and sent["alpha"]["bytes"] < 100
        shard_bytes = 2 * len(data) * (40_000 // 4 + 64)  # 2 shards a key per other cloud, about
        for cloud in ("beta", "gamma"):
            assert shard_bytes * 0.9 < sent[cloud]["bytes"] < shard_bytes * 1.2
            assert sent[cloud]["usd"] == pytest.approx(sent[cloud]["bytes"] / 1e9 * 0.09)
        for node_id in ("gamma-a", "gamma-b", "gamma-c"):  # gamma is lost, shards and all
            node = fleet[0][node_id][0]
            client = StoreClient(node.endpoint, SECRET)
            client.delete_many([shard_key(key, i) for key in data for i in range(6)])
            client.close()
        assert pool.get_many(list(data)) == list(data.values())


def test_without_the_service_ca_other_clouds_are_left_out(fleet, caplog):
    with caplog.at_level(logging.WARNING, logger="orchestrator.replica.kv.pool"):
        pool, meter = open_pool(fleet, "alpha-a", "cloud", with_ca=False)
    with pool:
        assert {n.cloud for n in pool.peers()} == {"alpha"}
        pool.put("lonely", b"x" * 1000)
        assert pool.get("lonely") == b"x" * 1000
    assert "left out: no service CA" in caplog.text and "placing best effort" in caplog.text
    assert meter.snapshot() == {}


def test_tls_handshake_is_verified_against_the_service_ca_and_its_name(fleet):
    procs, ca, other_ca = fleet
    node, _ = procs["gamma-a"]
    good = StoreClient(node.endpoint, SECRET, tls=PeerTLS(client_tls_context(str(ca)), store_server_name("gamma-a")))
    assert good.endpoint.startswith("https://")
    assert good.put("tls-key", b"sealed") and good.get("tls-key") == b"sealed"
    good.close()
    plain = StoreClient(node.endpoint, SECRET)  # the same port still speaks plain HTTP to its own cloud
    assert plain.get("tls-key") == b"sealed"
    plain.close()
    refusals = {
        "another service's CA": PeerTLS(client_tls_context(str(other_ca)), store_server_name("gamma-a")),
        "another store's name": PeerTLS(client_tls_context(str(ca)), store_server_name("gamma-b")),
    }
    for why, tls in refusals.items():
        bad = StoreClient(node.endpoint, SECRET, tls=tls)
        with pytest.raises(StoreUnavailable, match="TLS with .* failed: .*CERTIFICATE_VERIFY_FAILED"):
            bad.get("tls-key")
        bad.close()
        assert why  # both refused before any request was sent


def test_a_store_without_tls_refuses_a_tls_client(tmp_path, fleet):
    _, ca, _ = fleet
    proc = StoreProcess(secret_file(tmp_path))
    try:
        client = StoreClient(proc.endpoint, SECRET, tls=PeerTLS(client_tls_context(str(ca)), "x.kv-store.invalid"))
        with pytest.raises(StoreUnavailable):
            client.get("anything")
        client.close()
    finally:
        proc.kill()
