"""Small pieces several policies share: which replicas to give up first, cheapest location."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from policies.base import Phase, PolicyInput, ReplicaView
from providers.base import Location, Market

# SkyServe's scale_down_decision_order: give up the replicas furthest from serving first.
_PHASE_ORDER = {Phase.LAUNCHING: 0, Phase.NOT_READY: 1, Phase.DRAINING: 2, Phase.READY: 3}


def scale_down_order(replicas: Iterable[ReplicaView]) -> list[ReplicaView]:
    """Replicas in the order to remove them: earliest lifecycle phase first, then the newest
    (a later launch is the one that has had the least time to pay off)."""
    return sorted(replicas, key=lambda r: (_PHASE_ORDER[r.phase], -r.launched_at, _neg(r.replica_id)))


def _neg(replica_id: str) -> tuple[int, ...]:
    # Descending replica id without assuming ids are numbers.
    return tuple(-ord(c) for c in replica_id)


def cheapest(view: PolicyInput, market: Market, candidates: Sequence[Location] | None = None) -> Location | None:
    """The location with the lowest quoted price on `market` (ties: location order)."""
    best: tuple[float, Location] | None = None
    for loc in sorted(candidates if candidates is not None else view.locations):
        price = view.price(loc, market)
        key = (price if price is not None else float("inf"), loc)
        if best is None or key < best:
            best = key
    return best[1] if best else None


def count_by_location(replicas: Iterable[ReplicaView]) -> dict[Location, int]:
    out: dict[Location, int] = {}
    for r in replicas:
        out[r.location] = out.get(r.location, 0) + 1
    return out


def price_map(view: PolicyInput, market: Market) -> dict[Location, float]:
    """location -> lowest quoted price on `market`, in one pass over the price book."""
    out: dict[Location, float] = {}
    for o in view.offers:
        if o.market is market and (o.location not in out or o.price_per_hour < out[o.location]):
            out[o.location] = o.price_per_hour
    return out
