"""The price book: the latest quote per (location, instance type, market), its history and age.

Policies ask it "the k cheapest locations for A100:1" many times per decision, so offers are
bucketed by (accelerator, count, market) and each bucket keeps a lazily re-sorted list: a query
walks the cheapest entries only. The daemon's price job calls `refresh_prices`; history goes
to the state store's PriceQuote table (only quotes whose price changed, so the table grows with
the market's movements, not with the refresh rate). Every quote says where its price came from
(Offer.source: live, catalog, snapshot) and when it was taken; `provenance()` gives both with the
age, for `spotctl prices` and a dry run to print.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from providers.catalog.loader import CLOUDS, accelerator_for, catalog_offers, gpu_instance_types
from orchestrator.common.retry import backoff_delays
from providers.base import Location, Market, Offer, Offers, Provider, ProviderError, TransientError

log = logging.getLogger(__name__)

__all__ = [
    "PriceBook",
    "accelerator_for",
    "gpu_instance_types",
    "load_history",
    "provenance",
    "record_history",
    "refresh_prices",
    "snapshot_offers",
]

Key = tuple[Location, str, Market]
Bucket = tuple[str, int, Market]

DEFAULT_STALE_AFTER_S = 3600.0  # spot prices move at most a few times an hour


def _key(offer: Offer) -> Key:
    return (offer.location, offer.instance_type, offer.market)


def _bucket(accelerator: str, count: int, market: Market) -> Bucket:
    return (accelerator.lower(), count, market)


class PriceBook:
    """Latest offer per location+type+market, a bounded in-memory history, and staleness."""

    def __init__(self, stale_after_s: float = DEFAULT_STALE_AFTER_S, history_len: int = 32,
                 clock: Callable[[], float] = time.time):
        self.stale_after_s = stale_after_s
        self._clock = clock
        # The price job writes while the API and the controller read: one lock, held briefly.
        self._lock = threading.RLock()
        self._latest: dict[Key, Offer] = {}
        self._buckets: dict[Bucket, dict[Key, Offer]] = collections.defaultdict(dict)
        self._sorted: dict[Bucket, list[Offer]] = {}  # cache, dropped when its bucket changes
        self._history: dict[Key, collections.deque[Offer]] = {}
        self._history_len = history_len
        self._refreshed: dict[str, float] = {}
        self._cooldown_until: dict[str, float] = {}
        self._cooldown_delays: dict[str, Iterator[float]] = {}

    # ---- writing ---------------------------------------------------------------------

    def update(self, offers: Iterable[Offer]) -> list[Offer]:
        """Store the offers; returns those that are new or changed price (what history keeps)."""
        with self._lock:
            return self._update(offers)

    def _update(self, offers: Iterable[Offer]) -> list[Offer]:
        changed = []
        for offer in offers:
            key = _key(offer)
            old = self._latest.get(key)
            if old is not None and old.observed_at > offer.observed_at:
                continue  # an older quote never replaces a newer one
            self._latest[key] = offer
            bucket = _bucket(offer.accelerator, offer.accelerator_count, offer.market)
            self._buckets[bucket][key] = offer
            self._sorted.pop(bucket, None)
            if old is None or old.price_per_hour != offer.price_per_hour:
                changed.append(offer)
                self._history.setdefault(key, collections.deque(maxlen=self._history_len)).append(offer)
        return changed

    def mark_refreshed(self, cloud: str, at: float | None = None) -> None:
        self._refreshed[cloud] = self._clock() if at is None else at
        self._cooldown_until.pop(cloud, None)
        self._cooldown_delays.pop(cloud, None)

    # ---- per-cloud backoff (throttled clouds are skipped for a growing while) ----------

    def back_off(self, cloud: str) -> float:
        delays = self._cooldown_delays.setdefault(cloud, backoff_delays(base=30.0, cap=1800.0))
        delay = next(delays)
        self._cooldown_until[cloud] = self._clock() + delay
        return delay

    def cooling_down(self, cloud: str) -> bool:
        return self._clock() < self._cooldown_until.get(cloud, 0.0)

    # ---- reading ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._latest)

    def latest(self, location: Location, instance_type: str, market: Market) -> Offer | None:
        return self._latest.get((location, instance_type, market))

    def history(self, location: Location, instance_type: str, market: Market | None = None) -> list[Offer]:
        """In-memory price changes, oldest first (the store keeps the long history)."""
        markets = [market] if market else list(Market)
        with self._lock:
            out = [o for m in markets for o in self._history.get((location, instance_type, m), ())]
        return sorted(out, key=lambda o: o.observed_at)

    def age(self, offer: Offer, now: float | None = None) -> float:
        return max(0.0, (self._clock() if now is None else now) - offer.observed_at)

    def provenance(self, offer: Offer, now: float | None = None) -> dict:
        """Where a quote's price came from, when it was taken and how old it is."""
        return provenance(offer, self._clock() if now is None else now)

    def is_stale(self, offer: Offer, now: float | None = None) -> bool:
        return self.age(offer, now) > self.stale_after_s

    def stale(self, now: float | None = None) -> Offers:
        with self._lock:
            latest = list(self._latest.values())
        return Offers(o for o in latest if self.is_stale(o, now))

    def last_refreshed(self, cloud: str) -> float | None:
        return self._refreshed.get(cloud)

    def offers(self, accelerator: str | None = None, count: int | None = None, *,
               clouds: Iterable[str] | None = None, regions: Iterable[str] | None = None,
               market: Market | None = None, max_age_s: float | None = None) -> Offers:
        """All latest offers matching the filters, cheapest first."""
        cloud_set = set(clouds) if clouds else None
        region_set = set(regions) if regions else None
        now = self._clock()
        with self._lock:
            if accelerator is not None:
                markets = [market] if market else list(Market)
                pool = [o for b, entries in self._buckets.items()
                        if b[0] == accelerator.lower() and (count is None or b[1] == count) and b[2] in markets
                        for o in entries.values()]
            else:
                pool = [o for o in self._latest.values() if market is None or o.market is market]
        return Offers(o for o in pool
                      if (cloud_set is None or o.location.cloud in cloud_set)
                      and (region_set is None or o.location.region in region_set)
                      and (count is None or o.accelerator_count == count)
                      and (max_age_s is None or now - o.observed_at <= max_age_s)).sorted_by_price()

    def cheapest(self, accelerator: str, count: int = 1, k: int = 1, market: Market = Market.SPOT, *,
                 clouds: Iterable[str] | None = None, exclude: Iterable[Location] = (),
                 max_age_s: float | None = None) -> list[Offer]:
        """The cheapest offer in each of the k cheapest distinct locations (the policy's hot query)."""
        ranked = self._sorted.get(_bucket(accelerator, count, market))
        if ranked is None:
            ranked = self._rank(_bucket(accelerator, count, market))
        cloud_set = set(clouds) if clouds else None
        skip = set(exclude)
        oldest = self._clock() - max_age_s if max_age_s is not None else None
        out: list[Offer] = []
        for offer in ranked:
            loc = offer.location
            if loc in skip or (cloud_set is not None and loc.cloud not in cloud_set):
                continue
            if oldest is not None and offer.observed_at < oldest:
                continue
            skip.add(loc)
            out.append(offer)
            if len(out) == k:
                break
        return out

    def _rank(self, bucket: Bucket) -> list[Offer]:
        with self._lock:  # the ranked list is never mutated once built: readers need no lock
            entries = list(self._buckets.get(bucket, {}).values())
            ranked = sorted(entries, key=lambda o: (o.price_per_hour, o.location, o.instance_type))
            self._sorted[bucket] = ranked
        return ranked


# ---- snapshot ---------------------------------------------------------------------------


def snapshot_offers(clouds: Iterable[str] = CLOUDS) -> tuple[list[Offer], list[str]]:
    """Offers from SkyPilot's catalogs (seeded from the shipped snapshot); also each cloud's source."""
    offers, sources = [], []
    for cloud in clouds:
        found = catalog_offers(cloud)
        offers.extend(found)
        sources.append(f"{cloud}:{found[0].source if found else 'empty'}")
    return offers, sources


def provenance(offer: Offer, now: float | None = None) -> dict:
    """{"source", "observed_at", "age_s"} of one quote (source "unknown" when the offer has none)."""
    now = time.time() if now is None else now
    return {"source": offer.source or "unknown", "observed_at": offer.observed_at,
            "age_s": round(max(0.0, now - offer.observed_at), 1)}


# ---- the daemon's price job ---------------------------------------------------------------


def refresh_prices(providers: Iterable[Provider] | Mapping[str, Provider], book: PriceBook, engine=None) -> int:
    """Ask every provider for offers, store them (and their changes in the history table).

    Returns the number of offers refreshed. Providers retry throttled calls themselves (with
    orchestrator.common.retry); a cloud still throttled after that is skipped for a growing cool-down
    (`book.cooling_down`), so one slow cloud never delays the others' prices. Any other
    provider error (bad credentials, ...) is logged and that cloud keeps its old quotes.
    `engine` (a state Store or a SQLAlchemy engine; None: no history) gets the changed quotes.
    """
    items = providers.values() if isinstance(providers, Mapping) else providers
    total = 0
    for provider in items:
        cloud = provider.name
        if book.cooling_down(cloud):
            continue
        try:
            offers = provider.offers()
        except TransientError as err:
            log.warning("prices %s: throttled, next try in %.0f s: %s", cloud, book.back_off(cloud), err)
            continue
        except ProviderError as err:
            log.warning("prices %s: %s", cloud, err)
            continue
        changed = book.update(offers)
        book.mark_refreshed(cloud)
        if engine is not None and changed:
            record_history(engine, changed)
        total += len(offers)
    return total


# ---- history in the state store ---------------------------------------------------------


def record_history(target, offers: Iterable[Offer]) -> int:
    """Append the offers to the PriceQuote table; returns how many rows were written.

    `target` is the state Store (its record_offers also keeps each location's cheapest price)
    or a bare SQLAlchemy engine.
    """
    offers = list(offers)
    if hasattr(target, "record_offers"):
        return target.record_offers(offers)
    from sqlmodel import Session

    from orchestrator.control.store import PriceQuote

    rows = [PriceQuote(cloud=o.location.cloud, region=o.location.region, zone=o.location.zone,
                       instance_type=o.instance_type, accelerator=o.accelerator,
                       accelerator_count=o.accelerator_count, market=o.market.value,
                       price_per_hour=o.price_per_hour, observed_at=o.observed_at) for o in offers]
    if rows:
        with Session(target) as session:
            session.add_all(rows)
            session.commit()
    return len(rows)


def load_history(target, zone: str, instance_type: str, *, cloud: str | None = None,
                 market: Market | None = None, limit: int = 500) -> list[Offer]:
    """Stored quotes for one zone and instance type, oldest first (the newest `limit`).

    `target` is the state Store or a SQLAlchemy engine.
    """
    from sqlmodel import Session, select

    from orchestrator.control.store import PriceQuote

    query = select(PriceQuote).where(PriceQuote.zone == zone, PriceQuote.instance_type == instance_type)
    if cloud:
        query = query.where(PriceQuote.cloud == cloud)
    if market:
        query = query.where(PriceQuote.market == market.value)
    query = query.order_by(PriceQuote.observed_at.desc()).limit(limit)
    with Session(getattr(target, "engine", target)) as session:
        rows = session.exec(query).all()
    return [Offer(Location(r.cloud, r.region, r.zone), r.instance_type, r.accelerator, r.accelerator_count,
                  Market(r.market), r.price_per_hour, r.observed_at) for r in reversed(rows)]
