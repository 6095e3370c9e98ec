"""What a policy learns from market events: hazard per failure domain, storms, notice lead.

- `Decaying`: an event count that halves every `half_life` seconds (so old trouble fades).
- `HazardBook`: one such count per zone, region and cloud; a zone's hazard is its own
  plus a share of its region's and its cloud's (trouble next door is a warning too).
- `StormDetector`: several distinct replicas warned or lost in one region (or cloud)
  within a window is a correlated preemption; the domain stays stormy until it has been
  quiet for `calm` seconds.
- `PriceTrend`: the last price and its fading slope per location.
- `NoticeTrust`: per cloud, whether notices come a cold start ahead of their preemptions.

Pure folds over (time, location) facts: no clock of their own, no I/O.
"""

from __future__ import annotations

import collections
import math

from providers.base import Location


class Decaying:
    __slots__ = ("half_life", "t", "value")

    def __init__(self, half_life: float):
        self.half_life = half_life
        self.value = 0.0
        self.t = 0.0

    def at(self, now: float) -> float:
        if self.value == 0.0 or now <= self.t:
            return self.value
        return self.value * math.exp2(-(now - self.t) / self.half_life)

    def add(self, now: float, amount: float = 1.0) -> None:
        self.value = self.at(now) + amount
        self.t = max(self.t, now)


def domains(loc: Location) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The zone's keys from leaf to root: zone, region, cloud."""
    return (loc.cloud, loc.region, loc.zone), (loc.cloud, loc.region), (loc.cloud,)


class HazardBook:
    """Decaying event weight per zone, region and cloud."""

    def __init__(self, half_life: float = 3 * 3600.0, region_share: float = 0.5, cloud_share: float = 0.25):
        self.half_life = half_life
        self.region_share = region_share
        self.cloud_share = cloud_share
        self._counts: dict[tuple[str, ...], Decaying] = {}

    def _get(self, key: tuple[str, ...]) -> Decaying:
        c = self._counts.get(key)
        if c is None:
            c = self._counts[key] = Decaying(self.half_life)
        return c

    def add(self, loc: Location, now: float, weight: float) -> None:
        for key in domains(loc):
            self._get(key).add(now, weight)

    def hazard(self, loc: Location, now: float) -> float:
        zone_key, region_key, cloud_key = domains(loc)
        zone = self._counts[zone_key].at(now) if zone_key in self._counts else 0.0
        region = self._counts[region_key].at(now) if region_key in self._counts else 0.0
        cloud = self._counts[cloud_key].at(now) if cloud_key in self._counts else 0.0
        # Each level already includes the levels below: share only what happened next door.
        return zone + self.region_share * (region - zone) + self.cloud_share * (cloud - region)


class StormDetector:
    """Correlated preemptions: enough distinct replicas hit in one domain within `window`.

    A region storms at `threshold` replicas; a whole cloud only at `cloud_threshold`
    replicas across at least two of its regions (one bad region is not a bad cloud).
    """

    def __init__(self, window: float = 600.0, threshold: int = 2, calm: float = 1800.0, cloud_threshold: int = 4):
        self.window, self.threshold, self.calm = window, threshold, calm
        self.cloud_threshold = cloud_threshold
        self._recent: dict[tuple[str, ...], collections.deque[tuple[float, str, str]]] = {}
        self._storm_until: dict[tuple[str, ...], float] = {}

    def hit(self, loc: Location, replica_id: str, now: float) -> list[str]:
        """Record one replica warned or lost; returns the domains that entered a storm."""
        started = []
        for key in domains(loc)[1:]:  # regions and clouds: zones are what we spread over
            q = self._recent.setdefault(key, collections.deque())
            q.append((now, replica_id, loc.region))
            while q and q[0][0] < now - self.window:
                q.popleft()
            replicas = {rid for _, rid, _ in q}
            if len(key) == 1:  # a cloud
                storming = len(replicas) >= self.cloud_threshold and len({reg for _, _, reg in q}) >= 2
            else:
                storming = len(replicas) >= self.threshold
            if storming:
                if not self.stormy_key(key, now):
                    started.append("/".join(key))
                self._storm_until[key] = now + self.calm
        return started

    def stormy_key(self, key: tuple[str, ...], now: float) -> bool:
        return self._storm_until.get(key, -math.inf) > now

    def stormy(self, loc: Location, now: float) -> bool:
        return any(self.stormy_key(key, now) for key in domains(loc)[1:])

    def storms(self, now: float) -> list[str]:
        """Domains in a storm now, as 'cloud/region' or 'cloud'."""
        return sorted("/".join(k) for k, until in self._storm_until.items() if until > now)


class PriceTrend:
    """Last price and a slope ($/hour per hour) per location, from the price book.

    The slope of the last change fades with `half_life`: a price that rose an hour ago
    and held still since is no longer rising.
    """

    def __init__(self, half_life: float = 3600.0):
        self.half_life = half_life
        self._last: dict[Location, tuple[float, float]] = {}  # loc -> (observed_at, price)
        self._slope: dict[Location, tuple[float, float]] = {}  # loc -> (slope, at)

    def update(self, loc: Location, price: float, observed_at: float) -> None:
        last = self._last.get(loc)
        if last is not None and price == last[1]:
            return
        if last is not None and observed_at > last[0]:
            self._slope[loc] = ((price - last[1]) / ((observed_at - last[0]) / 3600.0), observed_at)
        self._last[loc] = (observed_at, price)

    def expected(self, loc: Location, price: float, now: float, horizon_hours: float) -> float:
        """The price a replica placed now should expect: only rises count (falls are a bonus)."""
        slope, at = self._slope.get(loc, (0.0, now))
        if slope <= 0.0:
            return price
        return price + slope * math.exp2(-max(0.0, now - at) / self.half_life) * horizon_hours


class NoticeTrust:
    """Per cloud: do its preemption notices come early enough to replace a replica in time?

    Each loss of a serving replica is evidence: in time (warned at least a cold start ahead)
    or late (no notice, or a shorter one). Late evidence decays with `half_life`; a cloud is
    trusted once a notice came in time and no late one is recent.
    """

    def __init__(self, half_life: float = 24 * 3600.0):
        self.half_life = half_life
        self._in_time: dict[str, int] = {}
        self._late: dict[str, Decaying] = {}

    def record(self, cloud: str, in_time: bool, now: float) -> None:
        if in_time:
            self._in_time[cloud] = self._in_time.get(cloud, 0) + 1
        else:
            self._late.setdefault(cloud, Decaying(self.half_life)).add(now)

    def trusted(self, cloud: str, now: float) -> bool:
        late = self._late.get(cloud)
        return self._in_time.get(cloud, 0) > 0 and (late is None or late.at(now) < 0.5)
