"""hazard_hedge: the project's default policy, a hedge that uses what SpotHedge throws away.

1. A notice counts as the loss it announces: the replacement (and an on-demand cover where
   READY spot falls short of the target) is launched when it arrives.
2. The spec's overprovision (SkyServe's num_overprovision) is held only while a cloud's
   notices cannot replace a replica in time; once a notice has come a cold start ahead of
   its preemption, and none too late since, the extra replicas go; they go too while the
   target has served half a day from distinct zones that lost nothing for a week (a spare
   guards against losses such zones do not have). While hedging, the mix
   of spot and on-demand is the cheapest that survives losing any spot replica, or every
   replica in a zone whose capacity came back lately (such capacity goes again soonest).
3. On-demand covers only what spot cannot; a cover is launched for a shortfall no starting
   spot replica meets and kept until READY spot meets it. One loss brings at most one
   replacement and one cover. A lone spot replica beside an on-demand cover of the whole
   target lowers nothing: it is given back and its zone parked until another zone grants.
   Placement: empty calm zones first (a storm makes its region or cloud one failure domain:
   spot moves to calm markets in other regions or clouds first), then one pile; live price
   (plus its rising trend) x (1 + decaying hazard of zone, region, cloud); refusals back
   off per zone, a notice or preemption blocks its zone a while. docs/policies.md has the
   reasoning and the numbers.
"""

from __future__ import annotations

import functools
import math

from policies.base import (
    Decision,
    EventKind,
    Launch,
    MarketEvent,
    Phase,
    PlacementPolicy,
    PolicyInput,
    Removal,
    ReplicaView,
)
from policies.common import count_by_location, price_map, scale_down_order
from policies.hazard import HazardBook, NoticeTrust, PriceTrend, StormDetector
from providers.base import Location, Market

_EVENT_WEIGHT = {EventKind.NOTICE: 1.0, EventKind.PREEMPTED: 1.0, EventKind.CAPACITY_ERROR: 0.3}
_UNBOUNDED = 1 << 30


class HazardHedgePolicy(PlacementPolicy):
    name = "hazard_hedge"
    description = "Default: acts on notices, hedges only while notices come late, on-demand only where spot cannot"

    def __init__(
        self,
        half_life: float = 3 * 3600.0,
        hazard_weight: float = 0.5,
        retry_base: float = 60.0,
        retry_max: float = 300.0,
        preempt_block: float = 600.0,
        young_for: float = 2700.0,
        storm_window: float = 600.0,
        storm_threshold: int = 2,
        calm: float = 1800.0,
        storm_guard: bool = False,
        cold_start_guess: float = 120.0,
        trend_horizon_hours: float = 1.0,
        trust_half_life: float = 24 * 3600.0,
        settled_for: float | None = 12 * 3600.0,
        settled_memory: float = 7 * 24 * 3600.0,
    ):
        self.hazard = HazardBook(half_life)
        self.storm = StormDetector(storm_window, storm_threshold, calm)
        self.trend = PriceTrend()
        self.trust = NoticeTrust(trust_half_life)
        self.hazard_weight = hazard_weight
        self.retry_base, self.retry_max, self.preempt_block = retry_base, retry_max, preempt_block
        self.young_for = young_for
        # The spare is waived while `need` replicas, one per zone, have served `settled_for`
        # in zones with no trouble for as long and no lost replica for `settled_memory`: a
        # zone that has lost one loses again (docs/policies.md), one that never did rarely.
        self.settled_for = settled_for  # None: never waived this way
        self.settled_memory = settled_memory
        self.storm_guard = storm_guard  # keep spot out of stormy domains and cover their replicas
        self.trend_horizon_hours = trend_horizon_hours
        self.cold_start = cold_start_guess  # learned: launch -> READY, smoothed
        self._fails: dict[Location, int] = {}  # refusals since the zone last granted
        self._blocked_until: dict[Location, float] = {}
        self._trouble_at: dict[Location, float] = {}  # last refusal, notice or preemption
        self._lost_at: dict[Location, float] = {}  # last notice or preemption
        self._serving: set[str] = set()  # replicas that reached READY
        self._warned: dict[str, tuple[float, bool]] = {}  # notice time, serving then
        self._ever_ready = False  # before the first READY replica nothing serves to cover
        self._cold_seen: set[str] = set()
        # Zones whose lone spot replica was given back (it could not lower on-demand): no spot
        # goes there until another zone grants, so the zone is not re-bought only to idle.
        self._parked: set[Location] = set()
        self._most_held: dict[Location, int] = {}  # the most spot replicas a zone held at once

    # ------------------------------------------------------------ learning from events

    def observe(self, event: MarketEvent) -> None:
        if event.kind is EventKind.READY:
            self._ever_ready = True
            if event.replica_id is not None:
                self._serving.add(event.replica_id)
        if event.market is not Market.SPOT:
            return
        loc, at, rid = event.location, event.at, event.replica_id
        weight = _EVENT_WEIGHT.get(event.kind)
        if event.kind is EventKind.CAPACITY_ERROR:
            n = self._fails[loc] = self._fails.get(loc, 0) + 1
            self._block(loc, at + min(self.retry_base * 2 ** min(n - 1, 30), self.retry_max))
        elif event.kind is EventKind.LAUNCHED:
            self._fails.pop(loc, None)  # the zone grants again
            if loc not in self._parked:
                self._parked.clear()  # a second zone grants: the parked ones are worth holding again
        elif event.kind is EventKind.NOTICE:
            if rid is not None:  # when, and whether it was serving (a starting one costs nothing)
                self._warned[rid] = (at, rid in self._serving)
            self._block(loc, at + self.preempt_block)
            self.storm.hit(loc, rid or f"{loc}@{at}", at)
        elif event.kind is EventKind.PREEMPTED:
            warned = self._warned.get(rid) if rid is not None else None
            if warned is not None:
                weight = 0.0  # already counted when the notice came
                if warned[1]:
                    self.trust.record(loc.cloud, at - warned[0] >= 0.95 * self.cold_start, at)
            elif rid is None or rid in self._serving:
                self.trust.record(loc.cloud, False, at)  # a serving replica lost without a word
            self._block(loc, at + self.preempt_block)
            self.storm.hit(loc, rid or f"{loc}@{at}", at)
        if event.kind in (EventKind.PREEMPTED, EventKind.TERMINATED) and rid is not None:
            self._warned.pop(rid, None)
            self._serving.discard(rid)
        if weight is not None and event.kind is not EventKind.LAUNCHED:
            self._trouble_at[loc] = max(self._trouble_at.get(loc, -math.inf), at)
            if event.kind is not EventKind.CAPACITY_ERROR:
                self._lost_at[loc] = max(self._lost_at.get(loc, -math.inf), at)
        if weight:
            self.hazard.add(loc, at, weight)

    def _block(self, loc: Location, until: float) -> None:
        self._blocked_until[loc] = max(self._blocked_until.get(loc, 0.0), until)

    def young(self, loc: Location, now: float) -> bool:
        """Trouble (a refusal, notice or preemption) in the zone within `young_for`: spot
        capacity that just came back is the likeliest to go again."""
        return now - self._trouble_at.get(loc, -math.inf) < self.young_for

    def _learn_cold_start(self, replicas) -> None:
        live = set()
        for r in replicas:
            live.add(r.replica_id)
            if r.ready_at is not None and r.replica_id not in self._cold_seen:
                self._cold_seen.add(r.replica_id)
                self.cold_start += 0.2 * ((r.ready_at - r.launched_at) - self.cold_start)
        self._cold_seen &= live
        # Replicas the controller removed leave no event here: forget them with their rows.
        self._serving &= live
        for rid in [rid for rid in self._warned if rid not in live]:
            del self._warned[rid]

    # ------------------------------------------------------------ what it tells a reader

    def overprovision(self, view: PolicyInput) -> int:
        """Extra spot replicas to hold: the spec's, unless every cloud's notices come in time
        or the target serves from settled zones."""
        wanted = view.params.num_overprovision
        if wanted and all(self.trust.trusted(cloud, view.now) for cloud in {loc.cloud for loc in view.locations}):
            return 0
        if wanted and self._settled(view):
            return 0
        return wanted

    def _settled(self, view: PolicyInput) -> list[ReplicaView] | None:
        """The spot replicas that make the spare needless: `need` of them in distinct zones,
        each serving `settled_for` in a zone calm as long and without a loss for
        `settled_memory`, and no storm (None: fewer such zones than `need`)."""
        if self.settled_for is None:
            return None
        now, need = view.now, view.target - view.params.base_ondemand_fallback_replicas
        oldest: dict[Location, ReplicaView] = {}
        for r in view.by_market(Market.SPOT):
            if r.phase is not Phase.READY or r.ready_at is None:
                continue
            if now - r.ready_at < self.settled_for:
                continue
            if now - self._trouble_at.get(r.location, -math.inf) < self.settled_for:
                continue
            if now - self._lost_at.get(r.location, -math.inf) < self.settled_memory:
                continue
            if r.location not in oldest or r.ready_at < oldest[r.location].ready_at:
                oldest[r.location] = r
        if need <= 0 or len(oldest) < need or self.storm.storms(now):
            return None
        # Keep the calmest zones (then the cheapest, then the longest serving).
        price = price_map(view, Market.SPOT)
        return sorted(oldest.values(), key=lambda r: (
            self.score(r.location, price.get(r.location, math.inf), now), r.ready_at, r.replica_id))[:need]

    def storms(self, now: float) -> list[str]:
        return self.storm.storms(now)

    def describe(self, now: float, locations: list[Location]) -> dict:
        """What the policy believes now, for status pages and logs (no decisions hang on it)."""
        return {
            "storms": self.storms(now),
            "trusted_notices": sorted({loc.cloud for loc in locations if self.trust.trusted(loc.cloud, now)}),
            "cold_start_s": round(self.cold_start, 1),
            "blocked": sorted(str(loc) for loc in locations if self._blocked_until.get(loc, 0.0) > now),
            "hazard": {str(loc): round(self.hazard.hazard(loc, now), 3) for loc in locations},
        }

    def score(self, loc: Location, price: float, now: float) -> float:
        """Expected $/hour of a spot replica placed at `loc` now, hazard-weighted."""
        expected = self.trend.expected(loc, price, now, self.trend_horizon_hours)
        return expected * (1.0 + self.hazard_weight * self.hazard.hazard(loc, now))

    # ------------------------------------------------------------ deciding

    def decide(self, view: PolicyInput) -> Decision:
        now = view.now
        self._learn_cold_start(view.replicas)
        spot_prices = price_map(view, Market.SPOT)
        for o in view.offers:
            if o.market is Market.SPOT:
                self.trend.update(o.location, o.price_per_hour, o.observed_at)
        decision = Decision()
        need = max(0, view.target - view.params.base_ondemand_fallback_replicas)  # what spot should serve
        # A warned replica is as good as gone: it is replaced, never counted.
        spot = [r for r in view.by_market(Market.SPOT) if r.phase is not Phase.DRAINING]
        for loc, n in count_by_location(r for r in spot if r.phase is not Phase.LAUNCHING).items():
            self._most_held[loc] = max(self._most_held.get(loc, 0), n)
        extra = self.overprovision(view) if view.params.use_spot else 0
        if not view.params.use_spot:
            decision.removals += [Removal(r.replica_id, "use_spot is off") for r in spot]
            spot, goal = [], 0
        elif extra:
            spot = self._park_lone_spot(view, spot, need, extra, decision)
            goal = self._hedge_size(view, spot, need, extra, spot_prices)
        else:
            goal = need
        if len(spot) < goal:
            self._place_spot(view, spot, goal - len(spot), spot_prices, decision)
        elif len(spot) > goal:
            for r in self._surplus(spot, goal, spot_prices, now, self._settled(view) if not extra else None):
                decision.removals.append(Removal(r.replica_id, f"spot above goal {goal}"))
        self._cover(view, spot, need, extra, decision)
        return decision

    def _park_lone_spot(self, view: PolicyInput, spot: list[ReplicaView], need: int, extra: int,
                        decision: Decision) -> list[ReplicaView]:
        """Give back spot that cannot lower on-demand: while hedging, `extra` or fewer READY
        spot replicas (nothing else of spot starting) leave on-demand at the whole target, which
        already serves. Their zones are parked; returns the spot replicas kept."""
        if not spot or len(spot) > extra or any(r.phase is not Phase.READY for r in spot):
            return spot
        if not all(self._fails.get(r.location) and self._most_held.get(r.location, 0) <= 1 for r in spot):
            return spot  # its zone may take more (now or as it did before): a second one lowers on-demand
        od_ready = [r for r in view.by_market(Market.ON_DEMAND) if r.phase is Phase.READY]
        if len(od_ready) < need:
            return spot
        for r in spot:
            self._parked.add(r.location)
            decision.removals.append(
                Removal(r.replica_id, f"spot cannot lower on-demand ({len(od_ready)} serve the target): "
                                      f"{r.location} parked until another zone grants")
            )
        return []

    def _candidates(self, view: PolicyInput) -> list[Location]:
        """Where a spot replica may go now: not backing off after a refusal, not being
        reclaimed (nor storming, with `storm_guard`), not parked."""
        now = view.now
        return [
            loc
            for loc in view.locations
            if self._blocked_until.get(loc, 0.0) <= now and loc not in self._parked
            and not (self.storm_guard and self.storm.stormy(loc, now))
        ]

    def _room(self, view: PolicyInput, spot: list[ReplicaView]) -> dict[Location, int]:
        """How many of the service's spot replicas each usable zone may hold: as many as it
        holds where it refused more (or is being reclaimed), else any number."""
        held = count_by_location(spot)
        room = dict(held)
        for loc in self._candidates(view):
            # A zone that refused since its last grant is probed one replica at a time.
            room[loc] = held.get(loc, 0) + 1 if self._fails.get(loc) else _UNBOUNDED
        for loc in self._parked:
            room.setdefault(loc, 1)  # it granted when last asked: counted on, once another zone grants
        return room

    def _hedge_size(self, view: PolicyInput, spot: list[ReplicaView], need: int, extra: int, prices) -> int:
        """Spot replicas to hold without usable notices: the cheapest mix of spot and on-demand
        with `need + extra` replicas in all that still serves `need` after losing any one spot
        replica, or every one in a young zone. Few settled zones mean more spot in them, or
        on-demand where that is cheaper."""
        now = view.now
        rooms = self._room(view, spot)
        zones = sorted(rooms, key=lambda loc: (self.young(loc, now), -rooms[loc]))  # settled first
        room = [rooms[loc] for loc in zones]
        young = [self.young(loc, now) for loc in zones]
        spot_price = sum(prices.values()) / len(prices) if prices else 1.0
        od_prices = price_map(view, Market.ON_DEMAND)
        od_price = min(od_prices.values()) if od_prices else 3.0 * spot_price
        best: tuple[float, int] | None = None
        for total in range(0, 2 * need + extra + 1):
            counts = _fill(room, total)
            if counts is None:
                break
            worst = max((c for c, y in zip(counts, young, strict=True) if y), default=0)
            od = max(0, need - (total - max(worst, 1 if total else 0)), need + extra - total)
            cost = total * spot_price + od * od_price
            if best is None or cost < best[0] - 1e-12:
                best = (cost, total)
        return best[1] if best else 0

    def _place_spot(self, view, spot: list[ReplicaView], n: int, prices, decision: Decision) -> None:
        now = view.now
        counts = count_by_location(spot)
        candidates = self._candidates(view)
        # A location the price book does not quote is still usable, at the dearest known price.
        unquoted = max(prices.values(), default=1.0)
        base_score = {loc: self.score(loc, prices.get(loc, unquoted), now) for loc in candidates}
        # A storm makes its region (or cloud) one failure domain: new spot goes to calm markets
        # elsewhere (another region or cloud) before the stormy ones, as it goes to settled
        # zones before young ones; on-demand covers only what no spot market can take.
        storms = self.storms(now)
        for i in range(n):
            if not candidates:
                break  # every zone refused or is being reclaimed (or storms, guarded): on-demand covers
            loc = min(candidates, key=lambda c: _placement_key(
                c, counts, self.young(c, now) or self.storm.stormy(c, now), base_score[c]))
            counts[loc] = counts.get(loc, 0) + 1
            price = f" at ${prices[loc]:.3f}/h" if loc in prices else ""
            where = ""
            if storms:
                stormy = self.storm.stormy(loc, now)
                where = f", {'inside' if stormy else 'calm market away from'} storm in {', '.join(storms)}"
            decision.launches.append(
                Launch(loc, Market.SPOT, f"spot {len(spot) + i + 1}/{len(spot) + n} in {loc}{price}{where}")
            )

    def _surplus(self, spot: list[ReplicaView], goal: int, prices, now: float,
                 keep: list[ReplicaView] | None = None) -> list[ReplicaView]:
        """The replicas beyond `goal`: starting ones first, then READY ones outside `keep`,
        then from the most crowded zone, then the priciest or most hazardous."""
        counts = count_by_location(spot)
        kept = {r.replica_id for r in keep or ()}

        def key(r: ReplicaView):
            score = self.score(r.location, prices.get(r.location, math.inf), now)
            return (r.phase is Phase.READY, r.replica_id in kept, -counts[r.location], -score, r.replica_id)

        return sorted(scale_down_order(spot), key=key)[: len(spot) - goal]

    def _cover(self, view: PolicyInput, spot: list[ReplicaView], need: int, extra: int, decision: Decision) -> None:
        """On-demand = base + what spot cannot serve: READY spot short of `need` now, and, when
        hedging, what losing a spot replica (or a young zone's all) would leave short. A cover is launched
        only for a shortfall the starting spot replicas do not meet, and kept until READY spot
        meets it; starting covers count."""
        now = view.now
        base = view.params.base_ondemand_fallback_replicas
        on_demand = view.by_market(Market.ON_DEMAND)
        if not view.params.use_spot:
            launch_goal = keep_goal = view.target
        else:
            ready = [
                r for r in spot
                if r.phase is Phase.READY and not (self.storm_guard and self.storm.stormy(r.location, now))
            ]
            # Starting spot counts as on its way, except probes of zones that refused lately.
            planned = [r.location for r in spot if r.phase is not Phase.READY]
            planned += [x.location for x in decision.launches if x.market is Market.SPOT]
            planned = [loc for loc in planned if not self._fails.get(loc)]
            short_now = need - len(ready)
            launch_short = short_now
            if not self._ever_ready and not extra:
                # The first cold start: spot asked for now is READY no later than on-demand would be.
                launch_short -= len(planned)
            keep_short = short_now
            if extra:
                young = functools.partial(self.young, now=now)
                after_loss = _survivors(count_by_location(ready), young)
                planned_counts = count_by_location(ready)
                for loc in planned:
                    planned_counts[loc] = planned_counts.get(loc, 0) + 1
                keep_short = max(keep_short, need - after_loss, need + extra - len(ready))
                launch_short = max(
                    launch_short, need - _survivors(planned_counts, young), need + extra - len(ready) - len(planned)
                )
            launch_goal = min(view.target, base + max(0, launch_short))
            keep_goal = min(view.target, base + max(0, keep_short, launch_short))
        if launch_goal > len(on_demand):
            storms = self.storms(now)
            why = f"storm in {', '.join(storms)}" if storms else f"spot short of {launch_goal - base}"
            od_prices = price_map(view, Market.ON_DEMAND)
            loc = min(view.locations, key=lambda c: (od_prices.get(c, math.inf), c))
            for _ in range(launch_goal - len(on_demand)):
                decision.launches.append(Launch(loc, Market.ON_DEMAND, f"on-demand cover: {why}"))
        elif keep_goal < len(on_demand):
            for r in scale_down_order(on_demand)[: len(on_demand) - keep_goal]:
                decision.removals.append(Removal(r.replica_id, f"spot recovered: on-demand goal {keep_goal}"))


def _survivors(counts: dict[Location, int], young) -> int:
    """Replicas left after losing one of them, or every one in the young zone holding most."""
    worst = max((n for loc, n in counts.items() if young(loc)), default=0)
    return sum(counts.values()) - max(worst, 1 if counts else 0)


def _placement_key(loc: Location, counts: dict[Location, int], young: bool, score: float):
    """A zone holding none of the service's spot replicas first (losing one zone then costs
    one replica), a settled one before a young one; past that, pile onto one zone (a second
    crowded zone would be a second way to lose two at once); then the best expected price."""
    n = counts.get(loc, 0)
    return (min(n, 1), young, n < 2, score, loc)


def _fill(room: list[int], total: int) -> list[int] | None:
    """Where `total` replicas go as `_placement_key` places them, zones in order of preference
    (None: they do not fit)."""
    counts = [0] * len(room)
    for _ in range(total):
        open_zones = [i for i in range(len(room)) if counts[i] < room[i]]
        if not open_zones:
            return None
        i = min(open_zones, key=lambda i: (min(counts[i], 1), counts[i] < 2, i))
        counts[i] += 1
    return counts
