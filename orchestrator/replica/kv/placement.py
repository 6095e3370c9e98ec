"""Which stores hold the k+m shards of a group: pure, deterministic, failure-domain aware.

Every replica computes the same holders from the group key and the membership (the pool keeps a
Placement per membership), so no directory of shard locations is needed. The rules, in order:
no zone holds more than m shards of a group (feasible when zones x m >= k + m; otherwise strict
placement raises PlacementError, and best effort fills the least loaded zones beyond m, which
`zone_bound_feasible` tells the caller, who logs it); distinct stores before any takes a second
shard; the fewest shards per cloud, then region, then zone; ties by rendezvous hashing of
(key, node_id). A store that joins or leaves moves only the groups it holds a shard of: (k+m)/N
of them on a balanced topology, below 2(k+m)/N unless one domain is much thinner than the others
(docs/kv-cache.md has the argument).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from orchestrator.common.errors import UserError


@dataclass(frozen=True)
class StoreNode:
    """A shard store: the agent of one replica, with its failure domains."""

    node_id: str
    endpoint: str  # base URL, e.g. http://10.0.0.5:8701
    cloud: str
    region: str
    zone: str


class PlacementError(Exception):
    """The topology cannot satisfy the placement rules (strict mode)."""


_NODE_FIELDS = ("node_id", "endpoint", "cloud", "region", "zone")


def parse_nodes(items: Iterable[Mapping[str, object]]) -> list[StoreNode]:
    """StoreNodes from JSON-like dicts; UserError naming the first bad entry or field."""
    nodes: list[StoreNode] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise UserError(f"kv store #{index}: expected an object with fields {', '.join(_NODE_FIELDS)}")
        unknown = sorted(set(item) - set(_NODE_FIELDS))
        if unknown:
            raise UserError(f"kv store #{index}: unknown field {unknown[0]!r}")
        values = {}
        for name in _NODE_FIELDS:
            value = item.get(name)
            if not isinstance(value, str) or not value.strip():
                raise UserError(f"kv store #{index}: field {name!r} must be a non-empty string")
            values[name] = value.strip()
        if not values["endpoint"].startswith(("http://", "https://")):
            raise UserError(f"kv store #{index}: field 'endpoint' must start with http:// or https://")
        if values["node_id"] in seen:
            raise UserError(f"kv store #{index}: duplicate node_id {values['node_id']!r}")
        seen.add(values["node_id"])
        nodes.append(StoreNode(**values))
    return nodes


def zone_bound_feasible(nodes: Iterable[StoreNode], k: int, m: int) -> bool:
    """Whether every group can keep <= m shards per zone with these stores."""
    return len({(n.cloud, n.region, n.zone) for n in nodes}) * m >= k + m


def _hrw_weight(key: bytes, node_id: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + node_id, digest_size=8).digest(), "big")


class Placement:
    """`place` for one membership, with the per-membership work done once (the pool keeps
    one; placing a key then costs N hashes and a (k+m) x N scan of small ints). Raises
    PlacementError without stores, for k or m below 1, or (strict) when the zones cannot
    keep <= m shards each."""

    def __init__(self, nodes: Iterable[StoreNode], k: int, m: int, *, strict: bool = True):
        self.members = tuple(sorted(set(nodes), key=lambda n: n.node_id))
        if not self.members:
            raise PlacementError("no shard stores to place on")
        if k < 1 or m < 1:
            raise PlacementError(f"invalid code k={k}, m={m}")
        self.k, self.m = k, m
        self.feasible = zone_bound_feasible(self.members, k, m)
        if strict and not self.feasible:
            zones = len({(n.cloud, n.region, n.zone) for n in self.members})
            raise PlacementError(
                f"{zones} zone(s) cannot hold {k}+{m} shards with at most {m} per zone; "
                f"need at least {-(-(k + m) // m)} zones"
            )
        self._ids = [n.node_id.encode() for n in self.members]
        self._cloud = _indices([n.cloud for n in self.members])
        self._region = _indices([(n.cloud, n.region) for n in self.members])
        self._zone = _indices([(n.cloud, n.region, n.zone) for n in self.members])

    def holders(self, key: str) -> list[StoreNode]:
        """Element i holds shard i (0..k-1 data, then parity)."""
        raw = key.encode()
        weights = [_hrw_weight(raw, node_id) for node_id in self._ids]
        order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))  # HRW rank: the last tie-break
        cloud, region, zone, m = self._cloud, self._region, self._zone, self.m
        per_node = [0] * len(order)
        per_cloud, per_region, per_zone = [0] * (max(cloud) + 1), [0] * (max(region) + 1), [0] * (max(zone) + 1)
        open_zones = len(per_zone)  # zones still below m shards
        picks: list[int] = []
        for _ in range(self.k + m):
            best, best_rank = None, None
            for i in order:  # in rank order, so the first of equal counts wins
                if open_zones and per_zone[zone[i]] >= m:
                    continue
                rank = (per_node[i], per_cloud[cloud[i]], per_region[region[i]], per_zone[zone[i]])
                if best_rank is None or rank < best_rank:
                    best, best_rank = i, rank
                    if rank == (0, 0, 0, 0):
                        break  # nothing can beat an untouched store in an untouched cloud
            picks.append(best)
            per_node[best] += 1
            per_cloud[cloud[best]] += 1
            per_region[region[best]] += 1
            per_zone[zone[best]] += 1
            if per_zone[zone[best]] == m:
                open_zones -= 1
        return [self.members[i] for i in picks]


def _indices(labels: list) -> list[int]:
    """Each label as a small int (first appearance order)."""
    seen: dict = {}
    return [seen.setdefault(label, len(seen)) for label in labels]


def place(key: str, nodes: Iterable[StoreNode], k: int, m: int, *, strict: bool = True) -> list[StoreNode]:
    """The holders of the group's shards: element i holds shard i (0..k-1 data, then parity).
    Raises PlacementError as Placement does."""
    return Placement(nodes, k, m, strict=strict).holders(key)
