"""Which stores hold the k+m shards of a group: pure, deterministic, failure-domain aware.

Every replica computes the same holders from the group key, the membership and the writer's home
(the pool keeps a Placement per membership and home), so no directory of shard locations is
needed. The failure domain (zone, region or cloud) is the unit whose loss must leave k shards.
The scope: the cheapest part of the membership that can give that, seen from the writer's home
(`scope_of`): its region, then its cloud for `zone`; its cloud for `region`; every cloud for
`cloud` (without a home, the whole membership). Within the scope, in order: no domain holds more
than m shards of a group (feasible when domains x m >= k + m; otherwise strict placement raises
PlacementError, and best effort fills the least loaded domains beyond m, which `feasible` tells
the caller, who logs it); distinct stores before any takes a second shard; the fewest shards per
cloud, then region, then zone; ties by rendezvous hashing of (key, node_id). A store that joins
or leaves moves only the groups it holds a shard of: (k+m)/N of them on a balanced topology,
below 2(k+m)/N unless one domain is much thinner than the others (docs/kv-cache.md has the
argument).
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


FAILURE_DOMAINS = ("zone", "region", "cloud")
_NODE_FIELDS = ("node_id", "endpoint", "cloud", "region", "zone")


def domain_of(node: StoreNode, domain: str) -> tuple[str, ...]:
    """The failure-domain unit a store is in: (cloud, region, zone), (cloud, region) or (cloud,)."""
    return (node.cloud, node.region, node.zone)[:FAILURE_DOMAINS[::-1].index(domain) + 1]


def scope_of(nodes: Iterable[StoreNode], k: int, m: int, domain: str = "zone",
             home: StoreNode | None = None) -> list[StoreNode]:
    """The stores a writer at `home` places on: the smallest of its region (domain `zone`
    only), its cloud (`zone`, `region`), every cloud (`cloud`, or no home) whose domains can
    hold k+m shards with at most m each; the widest allowed one when none can. Shard traffic
    stays inside a cloud unless the domain is `cloud`."""
    nodes = list(nodes)
    if home is None or domain == "cloud":
        return nodes
    tiers = [lambda n: n.cloud == home.cloud]
    if domain == "zone":
        tiers.insert(0, lambda n: (n.cloud, n.region) == (home.cloud, home.region))
    for inside in tiers:
        scope = [n for n in nodes if inside(n)]
        if scope and domain_bound_feasible(scope, k, m, domain):
            return scope
    return [n for n in nodes if tiers[-1](n)] or nodes


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


def domain_bound_feasible(nodes: Iterable[StoreNode], k: int, m: int, domain: str = "zone") -> bool:
    """Whether every group can keep <= m shards per failure domain with these stores."""
    return len({domain_of(n, domain) for n in nodes}) * m >= k + m


def zone_bound_feasible(nodes: Iterable[StoreNode], k: int, m: int) -> bool:
    """Whether every group can keep <= m shards per zone with these stores."""
    return domain_bound_feasible(nodes, k, m, "zone")


def _hrw_weight(key: bytes, node_id: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + node_id, digest_size=8).digest(), "big")


class Placement:
    """`place` for one membership and home, with the per-membership work done once (the pool
    keeps one per home; placing a key then costs N hashes and a (k+m) x N scan of small
    ints). `members` are the stores of the scope (`scope_of`). Raises PlacementError without
    stores, for k or m below 1, an unknown domain, or (strict) when the scope's domains cannot
    keep <= m shards each."""

    def __init__(self, nodes: Iterable[StoreNode], k: int, m: int, *, strict: bool = True,
                 domain: str = "zone", home: StoreNode | None = None):
        if domain not in FAILURE_DOMAINS:
            raise PlacementError(f"unknown failure domain {domain!r} (expected one of {', '.join(FAILURE_DOMAINS)})")
        nodes = set(nodes)
        if not nodes:
            raise PlacementError("no shard stores to place on")
        if k < 1 or m < 1:
            raise PlacementError(f"invalid code k={k}, m={m}")
        self.members = tuple(sorted(scope_of(nodes, k, m, domain, home), key=lambda n: n.node_id))
        self.k, self.m, self.domain = k, m, domain
        self.feasible = domain_bound_feasible(self.members, k, m, domain)
        if strict and not self.feasible:
            units = len({domain_of(n, domain) for n in self.members})
            raise PlacementError(
                f"{units} {domain}(s) cannot hold {k}+{m} shards with at most {m} per {domain}; "
                f"need at least {-(-(k + m) // m)} {domain}s"
            )
        self._ids = [n.node_id.encode() for n in self.members]
        self._cloud = _indices([n.cloud for n in self.members])
        self._region = _indices([(n.cloud, n.region) for n in self.members])
        self._zone = _indices([(n.cloud, n.region, n.zone) for n in self.members])
        self._unit = _indices([domain_of(n, domain) for n in self.members])  # what the m bound counts

    def holders(self, key: str) -> list[StoreNode]:
        """Element i holds shard i (0..k-1 data, then parity)."""
        raw = key.encode()
        weights = [_hrw_weight(raw, node_id) for node_id in self._ids]
        order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))  # HRW rank: the last tie-break
        cloud, region, zone, unit, m = self._cloud, self._region, self._zone, self._unit, self.m
        per_node = [0] * len(order)
        per_cloud, per_region, per_zone = [0] * (max(cloud) + 1), [0] * (max(region) + 1), [0] * (max(zone) + 1)
        per_unit = [0] * (max(unit) + 1)
        open_units = len(per_unit)  # failure domains still below m shards
        picks: list[int] = []
        for _ in range(self.k + m):
            best, best_rank = None, None
            for i in order:  # in rank order, so the first of equal counts wins
                if open_units and per_unit[unit[i]] >= m:
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
            per_unit[unit[best]] += 1
            if per_unit[unit[best]] == m:
                open_units -= 1
        return [self.members[i] for i in picks]


def _indices(labels: list) -> list[int]:
    """Each label as a small int (first appearance order)."""
    seen: dict = {}
    return [seen.setdefault(label, len(seen)) for label in labels]


def place(key: str, nodes: Iterable[StoreNode], k: int, m: int, *, strict: bool = True, domain: str = "zone",
          home: StoreNode | None = None) -> list[StoreNode]:
    """The holders of the group's shards: element i holds shard i (0..k-1 data, then parity).
    Raises PlacementError as Placement does."""
    return Placement(nodes, k, m, strict=strict, domain=domain, home=home).holders(key)
