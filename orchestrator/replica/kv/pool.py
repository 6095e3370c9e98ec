"""An erasure-coded KV pool over the shard stores of the peer replicas: the one API the connector uses.

    pool = ErasureCodedPool(nodes, secret, k=4, m=2, timeout_s=2.0)  # nodes: placement.StoreNode
    pool.put_many([(key, payload), ...])  # encode, place, push; InsufficientShardsStored if < k
    pool.get_many(keys, into=None)        # decoded from any k valid shards; None: unrecoverable
    pool.has_many(keys)                   # >= k shards present (no shard data moves)
    pool.update_nodes(nodes)              # the membership changed: a new placement
    pool.repair_many(keys) -> Repaired    # put back what the current holders lack
    pool.close()                          # (also a context manager)

With a `home` (this replica's own store) writes stay within the cheapest scope that gives the
failure domain's survivability (placement.scope_of); reads ask the home scope's holders first and
the holders other homes would have chosen only for what is still missing. Stores in another cloud
than home are spoken to over TLS (`tls_context`: the service CA) and left out without one; a
`meter` counts the bytes that cross clouds or regions.

Thread-safe: the connector's scheduler lookups, saver, loads and repairer call it from their own
threads. docs/kv-cache.md has how it batches, waits and reads across membership changes.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from orchestrator.common.kvtls import store_server_name
from orchestrator.replica.kv.codec import Buffer, Codec, Shard, TooManyErasures, WrongPayloadLength
from orchestrator.replica.kv.egress import EgressMeter
from orchestrator.replica.kv.placement import Placement, StoreNode
from orchestrator.replica.kv.store import StoreClient, gather_until
from orchestrator.replica.kv.transport import PeerTLS

log = logging.getLogger(__name__)

PUT_REQUEST_BYTES = 32 << 20  # split one store's share of a put_many into bodies of about this size
GET_REQUEST_KEYS = 128  # and a get_many/has_many into requests of at most this many shards
PLACEMENT_HISTORY = 2  # previous memberships whose holders reads still ask


class Repaired(NamedTuple):
    """What one repair_many call did."""

    shards: list[int | None]  # per key: shards put back; None: unrecoverable
    bytes_moved: int  # shard bytes read from and written to the stores


class _View(NamedTuple):
    """One membership as the pool sees it, swapped whole so each call sees one."""

    placements: tuple[Placement, ...]  # newest first; the older ones are where earlier writes still are
    foreign: tuple[Placement, ...]  # the other homes' placements: where other replicas write
    clients: dict[str, StoreClient]  # by node_id
    nodes: dict[str, StoreNode]


class InsufficientShardsStored(Exception):
    """Fewer than k shards of a group could be stored: the key would not be recoverable."""


def shard_key(key: str, index: int) -> str:
    """The store key of shard `index` of group `key`."""
    return f"{key}#{index}"


class ErasureCodedPool:
    """Erasure-coded put/get of opaque payloads over the shard stores of `nodes` (ValueError
    without any; PlacementError for an unknown `domain`, or with strict_placement on a
    topology that cannot keep <= m shards per failure domain)."""

    def __init__(self, nodes: list[StoreNode], secret: str, k: int = 4, m: int = 2, timeout_s: float = 2.0,
                 *, strict_placement: bool = False, domain: str = "zone", home: StoreNode | None = None,
                 tls_context: ssl.SSLContext | None = None, meter: EgressMeter | None = None):
        self.k, self.m, self.timeout_s = k, m, timeout_s
        self.domain, self.home = domain, home
        self._codec = Codec(k, m)
        self._secret = secret
        self._strict = strict_placement
        self._tls_context = tls_context
        self._meter = meter
        self._lock = threading.Lock()
        self._view = _View((), (), {}, {})
        self._executor = ThreadPoolExecutor(max_workers=max(16, 4 * len(nodes)), thread_name_prefix="kv-pool")
        self.update_nodes(nodes)

    # -- membership ----------------------------------------------------------------------

    def update_nodes(self, nodes: list[StoreNode]) -> None:
        """Switch to a new membership. Writes go to the new holders; shards already written
        stay where they are, so reads and `has` also ask the holders under the previous
        PLACEMENT_HISTORY memberships (those still members), in the same round of requests.
        Raises ValueError for an empty list (PlacementError as the constructor)."""
        if not nodes:
            raise ValueError("the KV pool needs at least one shard store")
        nodes = self._reachable(nodes)
        placement = Placement(nodes, self.k, self.m, strict=self._strict, domain=self.domain, home=self.home)
        foreign = self._other_homes(nodes, placement)
        with self._lock:
            view, clients = self._view, {}
            old = view.clients
            for node in nodes:
                reuse = old.get(node.node_id)
                same = reuse is not None and view.nodes[node.node_id] == node  # same endpoint and cloud
                clients[node.node_id] = reuse if same else self._client(node)
            older = tuple(p for p in view.placements if p.members != placement.members)[:PLACEMENT_HISTORY]
            self._view = _View((placement, *older), foreign, clients, {n.node_id: n for n in nodes})
        for node_id, client in old.items():  # calls still using them fail over as erasures
            if clients.get(node_id) is not client:
                client.close()
        if not placement.feasible:
            log.warning("kv pool: %d store(s) within reach in too few %ss to keep <= %d of %d shards per %s "
                        "(kv.failure_domain: %s); placing best effort, a %s loss may lose cached blocks",
                        len(placement.members), self.domain, self.m, self.k + self.m, self.domain, self.domain,
                        self.domain)

    def _crosses_clouds(self, node: StoreNode) -> bool:
        return self.home is not None and node.cloud != self.home.cloud

    def _reachable(self, nodes: list[StoreNode]) -> list[StoreNode]:
        """The stores this pool may talk to: another cloud's only over TLS."""
        if self._tls_context is not None:
            return list(nodes)
        kept = [n for n in nodes if not self._crosses_clouds(n)]
        if len(kept) < len(nodes):
            log.warning("kv pool: %d store(s) in other clouds left out: no service CA to encrypt to them",
                        len(nodes) - len(kept))
        if not kept:
            raise ValueError("the KV pool has no shard store it may reach")
        return kept

    def _client(self, node: StoreNode) -> StoreClient:
        tls = (PeerTLS(self._tls_context, store_server_name(node.node_id))
               if self._crosses_clouds(node) and self._tls_context is not None else None)
        meter = self._meter
        on_bytes = None if meter is None else (lambda sent, received: meter.count(node, sent, received))
        return StoreClient(node.endpoint, self._secret, timeout_s=self.timeout_s, tls=tls, on_bytes=on_bytes)

    def _other_homes(self, nodes: list[StoreNode], own: Placement) -> tuple[Placement, ...]:
        """The placements of writers elsewhere (one per distinct scope), for reads."""
        out: dict[tuple, Placement] = {}
        for home in {(n.cloud, n.region): n for n in nodes}.values():
            placement = Placement(nodes, self.k, self.m, strict=False, domain=self.domain, home=home)
            if placement.members != own.members:
                out.setdefault(placement.members, placement)
        return tuple(out.values())

    def holders(self, key: str) -> list[StoreNode]:
        """The stores of shards 0..k+m-1 of `key` under the current membership."""
        return self._view.placements[0].holders(key)

    def peers(self) -> list[StoreNode]:
        """Every store of the current membership this pool may talk to."""
        return list(self._view.nodes.values())

    # -- writes --------------------------------------------------------------------------

    def put(self, key: str, payload: bytes | memoryview) -> None:
        """put_many of one key."""
        self.put_many([(key, payload)])

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Encode and store many payloads, one request per store (or per ~32 MiB of it).
        Raises InsufficientShardsStored when a key got fewer than k shards stored."""
        # One encoding per key: two (with two stripe ids) racing to the same shard keys
        # could leave fewer than k shards of either.
        items = list({key: (key, payload) for key, payload in items}.values())
        placement, clients = self._view.placements[0], self._view.clients
        per_node: dict[str, list[tuple[int, str, memoryview]]] = defaultdict(list)
        for item, (key, payload) in enumerate(items):
            frames = self._codec.encode(payload)
            for index, (frame, node) in enumerate(zip(frames, placement.holders(key), strict=True)):
                per_node[node.node_id].append((item, shard_key(key, index), frame))
        stored = [0] * len(items)

        def count(items_and_flags: tuple[list[int], list[bool]]) -> bool:
            for item, ok in zip(*items_and_flags, strict=True):
                stored[item] += ok
            return False  # wait for every store: each shard stored is one more erasure tolerated

        calls = [_call(clients[node_id].put_many, chunk) for node_id, shards in per_node.items()
                 for chunk in _chunks_by_bytes(shards, PUT_REQUEST_BYTES)]
        gather_until(self._executor, calls, count, self._deadline())
        short = [items[i][0] for i, n in enumerate(stored) if n < self.k]
        if short:
            raise InsufficientShardsStored(
                f"{len(short)} key(s) got fewer than k={self.k} of {self.k + self.m} shards stored "
                f"(first: {short[0]!r}); are the shard stores up?")

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: str) -> bytearray | None:
        """The payload (a writable bytearray), or None when it cannot be recovered."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str], into: Sequence[Buffer] | None = None) -> list[bytearray | Buffer | None]:
        """Each key's payload from the first k valid shards that arrive; None if unrecoverable.
        With `into` (one writable buffer per key), key i's payload is decoded straight into
        into[i], which is returned for it; a payload of another length is None."""
        out: list[bytearray | Buffer | None] = []
        for item, shards in enumerate(self._gather(keys)):
            try:
                out.append(self._codec.assemble(shards, into=None if into is None else into[item]))
            except (TooManyErasures, WrongPayloadLength):
                out.append(None)
        return out

    def _gather(self, keys: Sequence[str]) -> list[list[Shard]]:
        """The valid shards of each key, asked of every holder under this home's placements
        at once, then of the other homes' holders for the keys still short (cheapest first);
        a key's collection stops once k shards of one encoding are in."""
        history, foreign = self._view.placements, self._view.foreign
        parsed: list[list[Shard]] = [[] for _ in keys]
        self._gather_into(keys, parsed, history)
        short = [i for i, shards in enumerate(parsed) if not _has_stripe_of(shards, self.k)]
        if foreign and short:
            more = [[] for _ in short]
            self._gather_into([keys[i] for i in short], more, foreign)
            for i, shards in zip(short, more, strict=True):
                parsed[i].extend(shards)
        return parsed

    def _gather_into(self, keys: Sequence[str], parsed: list[list[Shard]], placements) -> None:
        complete = [False] * len(keys)
        remaining = [len(keys)]

        def collect(items_and_frames: tuple[list[tuple[int, int]], list[memoryview | None]]) -> bool:
            for (item, _), frame in zip(*items_and_frames, strict=True):
                shard = None if frame is None or complete[item] else self._codec.parse(frame)
                if shard is not None:
                    parsed[item].append(shard)
                    if _has_stripe_of(parsed[item], self.k):
                        complete[item] = True
                        remaining[0] -= 1
            return remaining[0] == 0

        gather_until(self._executor, self._key_calls(keys, "get_many", placements), collect, self._deadline())

    def has(self, key: str) -> bool:
        """Whether >= k shards of the key are present (cheap: no shard data moves)."""
        return self.has_many([key])[0]

    def has_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether >= k shards of each key are present (no shard data moves)."""
        return [len(found) >= self.k for found in self._present(keys, enough=self.k)]

    def _present(self, keys: Sequence[str], enough: int) -> list[set[int]]:
        """The shard indices of each key that some holder has; a key's count stops at `enough`."""
        present: list[set[int]] = [set() for _ in keys]
        remaining = [len(keys)]

        def count(items_and_flags: tuple[list[tuple[int, int]], list[bool]]) -> bool:
            for (item, index), ok in zip(*items_and_flags, strict=True):
                if ok and len(present[item]) < enough:
                    present[item].add(index)
                    remaining[0] -= len(present[item]) == enough
            return remaining[0] == 0

        placements = self._view.placements + self._view.foreign  # no shard data moves: ask every scope at once
        gather_until(self._executor, self._key_calls(keys, "has_many", placements), count, self._deadline())
        return present

    def _held_encodings(self, keys: Sequence[str]) -> list[dict[int, tuple[int, int]]]:
        """Per key, {shard index: (stripe, payload length)} of the shards its holders under the
        current membership have, read from their headers (no shard data moves)."""
        held: list[dict[int, tuple[int, int]]] = [{} for _ in keys]

        def note(items_and_heads: tuple[list[tuple[int, int]], list[memoryview | None]]) -> bool:
            for (item, index), head in zip(*items_and_heads, strict=True):
                claimed = None if head is None else self._codec.identify(head)
                if claimed is not None and claimed.index == index:
                    held[item][index] = (claimed.stripe, claimed.payload_len)
            return False

        calls = self._key_calls(keys, "head_many", self._view.placements[:1])
        gather_until(self._executor, calls, note, self._deadline())
        return held

    # -- repair --------------------------------------------------------------------------

    def repair_many(self, keys: Sequence[str]) -> Repaired:
        """Put back the shards of these groups that their holders under the current
        membership lack (a store that left took them, or a new store took over their place).
        Per key: how many shards were put back (0: the group was whole), or None when fewer
        than k valid shards of one encoding were found anywhere (it is a cache miss now);
        and the bytes it read and sent doing so (what a repair rate limit counts).

        The missing shards are re-encoded from the decoded payload with the group's own stripe
        id: byte for byte the shards that were lost, so they join the ones still stored. A
        holder's shard of another encoding of the key (two replicas wrote different payloads
        of it at once) counts as missing and is overwritten: the headers tell encodings apart.
        (A shard whose data is corrupt under an intact header is not: reads treat it as an
        erasure, repair does not read data to find it.)"""
        keys = list(dict.fromkeys(keys))
        placement, clients = self._view.placements[0], self._view.clients
        held = self._held_encodings(keys)
        out: list[int | None] = [0] * len(keys)
        broken = [item for item, found in enumerate(held)
                  if len(found) < self.k + self.m or len(set(found.values())) > 1]
        per_node: dict[str, list[tuple[int, str, memoryview]]] = defaultdict(list)
        moved = 0
        for item, shards in zip(broken, self._gather([keys[i] for i in broken]), strict=True):
            moved += sum(len(shard.frame) for shard in shards)
            encoding = self._codec.best_stripe(shards)
            if len(encoding) < self.k:
                out[item] = None
                continue
            first = next(iter(encoding.values()))
            payload = self._codec.assemble(list(encoding.values()))
            frames = self._codec.encode(payload, stripe=first.stripe)
            for index, node in enumerate(placement.holders(keys[item])):
                if held[item].get(index) != (first.stripe, first.payload_len) and node.node_id in clients:
                    per_node[node.node_id].append((item, shard_key(keys[item], index), frames[index]))

        def count(items_and_flags: tuple[list[int], list[bool]]) -> bool:
            for item, ok in zip(*items_and_flags, strict=True):
                out[item] += ok
            return False

        calls = [_call(clients[node_id].put_many, chunk) for node_id, shards in per_node.items()
                 for chunk in _chunks_by_bytes(shards, PUT_REQUEST_BYTES)]
        gather_until(self._executor, calls, count, self._deadline())
        moved += sum(len(frame) for shards in per_node.values() for _, _, frame in shards)
        return Repaired(out, moved)

    def _key_calls(self, keys: Sequence[str], operation: str, placements: Sequence[Placement]) -> list[Callable]:
        """One call of StoreClient.<operation> per holder (and per GET_REQUEST_KEYS shards)
        covering all shards of `keys` at their holders under `placements`; each returns
        ((item, shard index) pairs, results)."""
        clients = self._view.clients
        per_node: dict[str, list[tuple[tuple[int, int], str]]] = defaultdict(list)
        for item, key in enumerate(keys):
            asked: set[tuple[str, int]] = set()
            for placement in placements:
                for index, node in enumerate(placement.holders(key)):
                    if node.node_id in clients and (node.node_id, index) not in asked:
                        asked.add((node.node_id, index))
                        per_node[node.node_id].append(((item, index), shard_key(key, index)))
        return [_call(getattr(clients[node_id], operation), shards[i:i + GET_REQUEST_KEYS])
                for node_id, shards in per_node.items() for i in range(0, len(shards), GET_REQUEST_KEYS)]

    def _deadline(self) -> float:
        # Every call has its own timeout and one retry inside StoreClient; this bounds the whole.
        return 2 * self.timeout_s + 1.0

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients, self._view = self._view.clients, _View(self._view.placements, (), {}, {})  # later calls: no stores
        for client in clients.values():
            client.close()

    def __enter__(self) -> ErasureCodedPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _call(operation: Callable[[list], list], entries: list[tuple]) -> Callable[[], tuple[list[int], list]]:
    """A call for the executor: `operation` on the entries' payloads (all but the item index),
    returning the item indices beside the results so the caller can attribute them."""
    args = [entry[1] if len(entry) == 2 else entry[1:] for entry in entries]
    return lambda: ([entry[0] for entry in entries], operation(args))


def _has_stripe_of(shards: list[Shard], k: int) -> bool:
    """Whether k shards of one stripe (one encoding of the payload) are among these."""
    indices: dict[tuple[int, int], set[int]] = defaultdict(set)
    for shard in shards:
        indices[(shard.stripe, shard.payload_len)].add(shard.index)
    return max(map(len, indices.values()), default=0) >= k


def _chunks_by_bytes(shards: list[tuple[int, str, memoryview]], limit: int) -> list[list[tuple[int, str, memoryview]]]:
    chunks: list[list[tuple[int, str, memoryview]]] = [[]]
    size = 0
    for shard in shards:
        if chunks[-1] and size + len(shard[2]) > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(shard)
        size += len(shard[2])
    return chunks if chunks[0] else []
