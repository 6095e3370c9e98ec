"""Shard placement: the per-zone bound, spread over clouds, determinism, few moves on churn."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.common.errors import UserError
from orchestrator.replica.kv.placement import PlacementError, StoreNode, parse_nodes, place, zone_bound_feasible


def topology(shape: list[list[list[int]]]) -> list[StoreNode]:
    """shape[cloud][region][zone] = number of stores in that zone."""
    nodes = []
    for c, regions in enumerate(shape):
        for r, zones in enumerate(regions):
            for z, count in enumerate(zones):
                for i in range(count):
                    node_id = f"c{c}-r{r}-z{z}-n{i}"
                    nodes.append(StoreNode(node_id, f"http://{node_id}:1", f"c{c}", f"c{c}-r{r}", f"c{c}-r{r}-z{z}"))
    return nodes


shapes = st.lists(st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), min_size=1, max_size=3),
                  min_size=1, max_size=3)


def zone_of(node: StoreNode) -> tuple[str, str, str]:
    return node.cloud, node.region, node.zone


@settings(max_examples=300, deadline=None)
@given(shapes, st.integers(1, 8), st.integers(1, 4), st.text(min_size=1, max_size=20))
def test_zone_bound_and_spread_hold_for_random_topologies(shape, k, m, key):
    nodes = topology(shape)
    if not zone_bound_feasible(nodes, k, m):
        with pytest.raises(PlacementError, match="zone"):
            place(key, nodes, k, m)
        assert len(place(key, nodes, k, m, strict=False)) == k + m  # best effort still places all
        return
    holders = place(key, nodes, k, m)
    assert len(holders) == k + m
    assert max(Counter(zone_of(n) for n in holders).values()) <= m
    # distinct stores first: with one store per zone, a store takes a second shard only
    # when there are fewer than k+m of them
    if all(count == 1 for regions in shape for zones in regions for count in zones):
        assert max(Counter(n.node_id for n in holders).values()) == -(-(k + m) // len(nodes))
    # every cloud (and, within the cloud-balanced picks, as many zones as possible) is used
    clouds = {n.cloud for n in nodes}
    assert len({n.cloud for n in holders}) == min(len(clouds), k + m)
    # whatever the holders, losing any one zone leaves at least k shards
    for zone in {zone_of(n) for n in nodes}:
        assert sum(zone_of(n) != zone for n in holders) >= k


@settings(max_examples=50, deadline=None)
@given(shapes, st.text(min_size=1, max_size=20), st.randoms(use_true_random=False))
def test_placement_is_deterministic_whatever_the_order_of_members(shape, key, rnd):
    nodes = topology(shape)
    shuffled = list(nodes)
    rnd.shuffle(shuffled)
    assert place(key, nodes, 4, 2, strict=False) == place(key, shuffled, 4, 2, strict=False)


def moved_fraction(before: list[StoreNode], after: list[StoreNode], keys: list[str], k: int, m: int,
                   changed: StoreNode) -> float:
    moved = 0
    for key in keys:
        old, new = place(key, before, k, m), place(key, after, k, m)
        if old != new:
            moved += 1
            # only groups that the joining/leaving store holds (before or after) may move
            assert changed in old or changed in new
    return moved / len(keys)


@pytest.mark.parametrize("k, m", [(4, 2), (8, 4)])
def test_one_store_leaving_or_joining_moves_few_groups(k, m):
    nodes = topology([[[2, 2, 2], [2, 2, 2]], [[2, 2, 2], [2, 2, 2]]])  # 24 stores, 2 clouds, 12 zones
    keys = [f"block-{i}" for i in range(1500)]
    n = len(nodes)
    # Bound (placement.py's docstring): the fraction that moves is the share of groups the store
    # holds, (k+m)/N on this balanced topology; allow 2x for the hash's sampling noise.
    bound = 2 * (k + m) / n
    leaving = random.Random(7).choice(nodes)
    assert moved_fraction(nodes, [x for x in nodes if x != leaving], keys, k, m, leaving) <= bound
    joining = StoreNode("new", "http://new:1", "c0", "c0-r0", "c0-r0-z0")
    assert moved_fraction(nodes, [*nodes, joining], keys, k, m, joining) <= bound * n / (n + 1) + 0.01


def test_six_stores_in_three_zones_hold_one_shard_each():
    nodes = topology([[[2, 2, 2]]])
    for key in ("a", "b", "c"):
        assert sorted(n.node_id for n in place(key, nodes, 4, 2)) == sorted(n.node_id for n in nodes)


def test_spread_over_regions_when_one_cloud():
    nodes = topology([[[1, 1], [1, 1], [1, 1]]])  # one cloud, 3 regions of 2 zones
    holders = place("key", nodes, 4, 2)
    assert Counter(n.region for n in holders) == Counter({"c0-r0": 2, "c0-r1": 2, "c0-r2": 2})


def test_infeasible_topology_error_names_the_need():
    nodes = topology([[[3, 3]]])  # 2 zones: at most 2*2=4 of 6 shards
    with pytest.raises(PlacementError, match="need at least 3 zones"):
        place("k", nodes, 4, 2)
    holders = place("k", nodes, 4, 2, strict=False)
    assert Counter(zone_of(n) for n in holders) == Counter({("c0", "c0-r0", "c0-r0-z0"): 3,
                                                             ("c0", "c0-r0", "c0-r0-z1"): 3})


def test_no_stores_is_an_error():
    with pytest.raises(PlacementError, match="no shard stores"):
        place("k", [], 4, 2)


def test_parse_nodes_from_config():
    nodes = parse_nodes([{"node_id": "a", "endpoint": "http://127.0.0.1:9", "cloud": "local",
                          "region": "r", "zone": "z1"}])
    assert nodes == [StoreNode("a", "http://127.0.0.1:9", "local", "r", "z1")]


@pytest.mark.parametrize("entry, message", [
    ("nope", "kv store #0: expected an object"),
    ({"node_id": "a", "endpoint": "http://x", "cloud": "c", "region": "r"}, "field 'zone' must be"),
    ({"node_id": "a", "endpoint": "x:1", "cloud": "c", "region": "r", "zone": "z"}, "must start with http"),
    ({"node_id": "a", "endpoint": "http://x", "cloud": "c", "region": "r", "zone": "z", "rack": 1},
     "unknown field 'rack'"),
])
def test_parse_nodes_names_what_is_wrong(entry, message):
    with pytest.raises(UserError, match=message):
        parse_nodes([entry])


def test_parse_nodes_rejects_duplicate_ids():
    entry = {"node_id": "a", "endpoint": "http://x", "cloud": "c", "region": "r", "zone": "z"}
    with pytest.raises(UserError, match="duplicate node_id 'a'"):
        parse_nodes([entry, entry])
