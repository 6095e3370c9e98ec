"""The erasure-coded pool over 6 real shard stores in 3 zones: a whole zone down is tolerated."""

from __future__ import annotations

import os

import numpy as np
import pytest

from orchestrator.replica.kv.codec import HEADER_SIZE, Codec
from orchestrator.replica.kv.placement import StoreNode, parse_nodes
from orchestrator.replica.kv.pool import ErasureCodedPool, InsufficientShardsStored, Repaired, shard_key
from orchestrator.replica.kv.store import StoreClient
from orchestrator.replica.kv.repair import Repairer
from orchestrator.replica.kv.saver import KnownKeys
from orchestrator.replica.kv.stats import KVStats
from tests.helpers import wait_for
from tests.fakes.kv_stores import SECRET, StoreProcess, secret_file

ZONES = ("zone-a", "zone-b", "zone-c")


@pytest.fixture
def cluster(tmp_path):
    """6 stores, 2 per zone; yields (pool, {node_id: StoreProcess}, nodes)."""
    secret = secret_file(tmp_path)
    procs: dict[str, StoreProcess] = {}
    nodes: list[StoreNode] = []
    try:
        for zone in ZONES:
            for i in range(2):
                node_id = f"{zone}-{i}"
                procs[node_id] = StoreProcess(secret, max_bytes=64 << 20)
                nodes.append(StoreNode(node_id, procs[node_id].endpoint, "local", "local-1", zone))
        pool = ErasureCodedPool(nodes, SECRET, k=4, m=2, timeout_s=5.0)
        yield pool, procs, nodes
        pool.close()
    finally:
        for proc in procs.values():
            proc.kill()


def payloads(n: int) -> dict[str, bytes]:
    return {f"prefix-hash-{i:04d}/layer-{i % 3}": os.urandom(1 + 7919 * i) for i in range(n)}


def test_put_get_has_round_trip(cluster):
    pool, _, _ = cluster
    data = payloads(12)
    first, *rest = data.items()
    pool.put(*first)
    pool.put_many(rest)
    for key, value in data.items():
        assert pool.get(key) == value
    assert pool.get_many([*data, "absent"]) == [*data.values(), None]
    assert pool.get_many([first[0], first[0]]) == [first[1], first[1]]
    assert pool.has_many([*data, "absent"]) == [True] * len(data) + [False]
    assert pool.has(first[0]) and not pool.has("absent")


def test_get_many_decodes_into_the_callers_buffers(cluster):
    pool, procs, _ = cluster
    data = {"a": os.urandom(50_000), "b": os.urandom(50_000), "short": os.urandom(10)}
    pool.put_many(list(data.items()))
    procs["zone-a-0"].kill()  # some groups lose a data shard: rebuilt into the buffer too
    rows = np.zeros((4, 50_000), dtype=np.uint8)
    got = pool.get_many(["a", "b", "short", "absent"], into=list(rows))
    assert got[0] is not None and rows[0].tobytes() == data["a"] and rows[1].tobytes() == data["b"]
    assert got[2:] == [None, None]  # another length than its buffer; absent
    assert not rows[2:].any()


def test_a_whole_zone_down_is_tolerated_and_three_stores_down_is_not(cluster):
    pool, procs, _ = cluster
    data = payloads(10)
    pool.put_many(list(data.items()))
    for node_id in ("zone-b-0", "zone-b-1"):
        procs[node_id].kill()
    assert pool.get_many(list(data)) == list(data.values())
    assert all(pool.has_many(list(data)))
    assert all(pool.get(key) == value for key, value in data.items())
    # a third store gone: each group (one shard per store) has lost 3 > m shards
    procs["zone-c-0"].kill()
    assert pool.get_many(list(data)) == [None] * len(data)
    assert pool.has_many(list(data)) == [False] * len(data)
    # and a put cannot reach k stores any more
    with pytest.raises(InsufficientShardsStored, match="fewer than k=4"):
        pool.put("new", b"payload")


def test_put_succeeds_with_m_stores_down(cluster):
    pool, procs, _ = cluster
    procs["zone-a-0"].kill()
    procs["zone-c-1"].kill()
    pool.put("written-while-degraded", b"v" * 5000)
    assert pool.get("written-while-degraded") == b"v" * 5000


def test_corrupt_shards_are_erasures(cluster):
    pool, _, nodes = cluster
    pool.put("key", b"precious" * 1000)
    holders = pool.holders("key")
    by_id = {n.node_id: n for n in nodes}
    for index in (0, 5):  # overwrite two shards in place with damaged copies
        client = StoreClient(by_id[holders[index].node_id].endpoint, SECRET)
        shard = bytearray(client.get(shard_key("key", index)))
        shard[HEADER_SIZE + 3] ^= 0xFF
        client.put(shard_key("key", index), bytes(shard))
        client.close()
    assert pool.get("key") == b"precious" * 1000
    # a third damaged shard: fewer than k valid remain, so no data rather than wrong data
    client = StoreClient(by_id[holders[2].node_id].endpoint, SECRET)
    client.put(shard_key("key", 2), b"junk")
    client.close()
    assert pool.get("key") is None


def test_membership_update_reaches_new_stores(cluster, tmp_path):
    pool, procs, nodes = cluster
    before = {f"before-{i}": os.urandom(3000 + i) for i in range(30)}
    pool.put_many(list(before.items()))
    old_holders = {key: pool.holders(key) for key in before}
    extra = StoreProcess(secret_file(tmp_path))
    try:
        grown = [*nodes, StoreNode("zone-d-0", extra.endpoint, "local", "local-1", "zone-d")]
        pool.update_nodes(grown)
        moved = [key for key in before if pool.holders(key) != old_holders[key]]
        assert moved  # some groups have new holders now, yet their shards are where they were
        assert pool.get_many(list(before)) == list(before.values())
        assert all(pool.has_many(list(before)))
        procs["zone-a-0"].kill()  # and the old holders still count as erasure-tolerant
        procs["zone-a-1"].kill()
        assert pool.get_many(moved) == [before[key] for key in moved]
        keys = [f"after-{i}" for i in range(30)]
        pool.put_many([(k, k.encode() * 50) for k in keys])
        assert any(n.node_id == "zone-d-0" for k in keys for n in pool.holders(k))
        assert pool.get_many(keys) == [k.encode() * 50 for k in keys]
    finally:
        extra.kill()


def test_nodes_parse_from_json_config():
    nodes = parse_nodes([{"node_id": "r1", "endpoint": "http://127.0.0.1:1", "cloud": "local",
                          "region": "local-1", "zone": "a"}])
    with ErasureCodedPool(nodes, SECRET, timeout_s=0.5) as pool:
        assert pool.get("anything") is None  # store down: unrecoverable, not an exception
        assert not pool.has("anything")


def test_a_key_given_twice_in_one_put_many_keeps_the_last_payload(cluster):
    pool, _, _ = cluster
    pool.put_many([("dup", b"first" * 100), ("other", b"x"), ("dup", b"second" * 100)])
    assert pool.get_many(["dup", "other"]) == [b"second" * 100, b"x"]


def _whole_at_holders(pool: ErasureCodedPool, key: str) -> bool:
    """Every holder under the pool's current membership has its shard of `key`."""
    clients = {}
    try:
        for index, node in enumerate(pool.holders(key)):
            client = clients.setdefault(node.node_id, StoreClient(node.endpoint, SECRET))
            if not client.has(shard_key(key, index)):
                return False
        return True
    finally:
        for client in clients.values():
            client.close()


@pytest.fixture
def zone_a_replaced(cluster, tmp_path):
    """20 groups stored; then zone a is lost with both its stores, and two new stores in a
    zone d join. Yields (pool, procs, data)."""
    pool, procs, nodes = cluster
    data = payloads(20)
    pool.put_many(list(data.items()))
    for node_id in ("zone-a-0", "zone-a-1"):
        procs[node_id].kill()
    joined = [StoreProcess(secret_file(tmp_path)) for _ in range(2)]
    try:
        survivors = [n for n in nodes if n.zone != "zone-a"]
        pool.update_nodes(survivors + [StoreNode(f"zone-d-{i}", p.endpoint, "local", "local-1", "zone-d")
                                       for i, p in enumerate(joined)])
        assert not any(_whole_at_holders(pool, key) for key in data)  # each group lost 2 of 6
        yield pool, procs, data
    finally:
        for proc in joined:
            proc.kill()


def test_repair_puts_back_what_a_lost_zone_took_so_a_second_zone_loss_is_survived(zone_a_replaced):
    pool, procs, data = zone_a_replaced
    keys = list(data)
    repaired = pool.repair_many([*keys, "never-stored"]).shards
    assert all(n >= 2 for n in repaired[:-1]) and repaired[-1] is None, repaired
    assert all(_whole_at_holders(pool, key) for key in keys)
    assert pool.repair_many(keys) == ([0] * len(keys), 0)  # whole now: nothing moves
    # Zone b goes too. Unrepaired, each group would be down to zone c's 2 shards.
    for node_id in ("zone-b-0", "zone-b-1"):
        procs[node_id].kill()
    assert pool.get_many(keys) == list(data.values())


def test_repair_overwrites_the_shards_of_another_encoding_of_the_key(cluster):
    # Two replicas wrote different payloads of one key at once: its holders have 4 shards of
    # one encoding and 2 of the other. It reads fine, but one more loss would be a miss.
    pool, procs, _ = cluster
    key, kept, other = "raced", os.urandom(30_000), os.urandom(30_000)
    pool.put(key, kept)
    holders = pool.holders(key)
    for index, frame in list(enumerate(Codec(4, 2).encode(other)))[:2]:
        client = StoreClient(holders[index].endpoint, SECRET)
        assert client.put(shard_key(key, index), frame)
        client.close()
    assert pool.has(key) and pool.get(key) == kept
    first = pool.repair_many([key])
    assert first.shards == [2] and first.bytes_moved >= 6 * 7_500  # read 4 (or more), wrote 2
    assert pool.repair_many([key]) == ([0], 0)
    for node in holders[2:4]:  # two of the shards that were right all along
        procs[node.node_id].kill()
    assert pool.get(key) == kept  # unrepaired: 2 + 2 shards of two encodings, a miss


def test_the_repairer_walks_the_known_keys_after_a_change(zone_a_replaced):
    pool, _, data = zone_a_replaced
    known, stats = KnownKeys(), KVStats()
    known.add(["never-stored", *data])
    repairer = Repairer(pool, known, stats, settle_s=0.1, batch_keys=8)
    try:
        repairer.schedule()
        snapshot = wait_for(lambda: (s := stats.snapshot())["repair_passes"] and s, 60, "a repair pass")
    finally:
        repairer.close()
    assert snapshot["groups_repaired"] == len(data) and snapshot["shards_repaired"] >= 2 * len(data)
    assert snapshot["groups_unrecoverable"] == 1 and snapshot["repair_failures"] == 0
    assert "never-stored" not in known and all(key in known for key in data)  # a lost one may be pushed again
    assert all(_whole_at_holders(pool, key) for key in data)


class _FakeWait:
    """A wait on a fake clock: it advances the clock instead of sleeping."""

    def __init__(self, clock: list[float]):
        self.clock, self.waited = clock, 0.0

    def __call__(self, seconds: float) -> None:
        self.clock[0] += seconds
        self.waited += seconds


class _PoolMoving:
    """Each repair_many call moves `per_batch` bytes (the rate limit's only input)."""

    def __init__(self, per_batch: int):
        self.per_batch = per_batch

    def repair_many(self, keys):
        return Repaired([1] * len(keys), self.per_batch)


@pytest.mark.parametrize("limit, least_wait", [(None, 0.0), (10e6, 10 * 5e6 / 10e6)])
def test_a_repair_pass_keeps_to_its_byte_rate_limit(limit, least_wait):
    clock = [100.0]
    known, stats = KnownKeys(), KVStats()
    known.add([f"key-{i}" for i in range(40)])
    stop = _FakeWait(clock)
    repairer = Repairer(_PoolMoving(5_000_000), known, stats, batch_keys=4, pause_s=0.0,
                        max_bytes_per_s=limit, clock=lambda: clock[0], wait=stop)
    try:
        done = repairer.repair_pass()  # run here: the background thread waits for a schedule()
    finally:
        repairer.close()
    assert done["repair_bytes"] == 10 * 5_000_000 and done["shards_repaired"] == 40
    assert stop.waited == pytest.approx(least_wait)  # 50 MB at 10 MB/s: 5 s in all
    assert stats.snapshot()["repair_bytes"] == 50_000_000
