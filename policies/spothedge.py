"""SpotHedge, reimplemented from SkyServe's shipped code (the baseline to beat).

Follows skypilot 0.14.1 `sky/serve/spot_placer.py` (DynamicFallbackSpotPlacer) and
`sky/serve/autoscalers.py` (FallbackRequestRateAutoscaler) step by step:

- every location is ACTIVE or PREEMPTED; all start ACTIVE;
- a spot preemption or a failed spot launch marks its location PREEMPTED; a spot launch
  that succeeded marks it ACTIVE again (replica_managers: `set_active` when the launch
  thread finishes without error);
- when fewer than 2 locations stay ACTIVE, all are reset to ACTIVE;
- a new spot replica goes to the cheapest ACTIVE location not already holding one of the
  service's spot replicas, else to the cheapest ACTIVE location; replicas launched in the
  same round see each other (the shipped code re-reads serve_state per launch);
- prices come from a static catalog: the first price seen for a location is kept forever
  (`location2cost` is a cache that is never refreshed);
- spot goal = target + num_overprovision - base_ondemand_fallback_replicas, counted
  against all non-terminal spot replicas (launching ones included);
- on-demand goal = base + (dynamic_ondemand_fallback ? max(0, spot goal - READY spot) : 0),
  capped at target ("don't launch on-demand fallback for overprovisioned replicas");
- surplus replicas are removed earliest-phase first, newest first
  (`_select_nonterminal_replicas_to_scale_down`); on-demand goes to the cheapest
  on-demand location (SkyPilot's optimizer);
- preemption notices are ignored (skypilot#5371): a warned replica counts as what it
  was, READY if it had been ready.

Where the paper (SkyServe, EuroSys'25) reads differently, the code wins here: the paper
presents spreading over failure domains (zones, regions, clouds) and overprovisioning
N_extra as one algorithm; the shipped placer only compares individual locations by price
and never looks at regions or clouds, and it never moves a running replica.

Knobs: read from `PolicyInput.params` (the service's replica_policy), exactly like
SkyServe. The simulator's defaults match SkyServe's evaluation of SpotHedge:
num_overprovision=1, dynamic_ondemand_fallback=true, base_ondemand_fallback_replicas=0.
Constructor arguments override them (for experiments).
"""

from __future__ import annotations

import dataclasses
import enum

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
from policies.common import scale_down_order
from providers.base import Location, Market


class LocationStatus(str, enum.Enum):
    ACTIVE = "active"
    PREEMPTED = "preempted"


class SpotHedgePolicy(PlacementPolicy):
    name = "spothedge"
    description = "SkyServe's SpotHedge as shipped: cheapest unused active zone, overprovision, on-demand fallback"

    def __init__(
        self,
        num_overprovision: int | None = None,
        dynamic_ondemand_fallback: bool | None = None,
        base_ondemand_fallback_replicas: int | None = None,
    ):
        self._overrides = (num_overprovision, dynamic_ondemand_fallback, base_ondemand_fallback_replicas)
        self.status: dict[Location, LocationStatus] = {}
        self._catalog_cost: dict[tuple[Location, Market], float] = {}
        self._early: list[MarketEvent] | None = []  # events seen before the locations were

    # --- the placer (spot_placer.py) ---

    def _know(self, locations) -> None:
        for loc in locations:
            self.status.setdefault(loc, LocationStatus.ACTIVE)

    def active_locations(self) -> list[Location]:
        return sorted(loc for loc, st in self.status.items() if st is LocationStatus.ACTIVE)

    def set_active(self, location: Location) -> None:
        self.status[location] = LocationStatus.ACTIVE

    def set_preemptive(self, location: Location) -> None:
        self.status[location] = LocationStatus.PREEMPTED
        if len(self.active_locations()) < 2:  # prevent the case with only one active location
            for loc in self.status:
                self.status[loc] = LocationStatus.ACTIVE

    def observe(self, event: MarketEvent) -> None:
        if event.market is not Market.SPOT:
            return
        if self._early is not None:
            # The shipped placer knows every location before the first event; the reset
            # rule depends on how many there are, so wait for the first decide to say.
            self._early.append(event)
            return
        self._know([event.location])
        if event.kind in (EventKind.PREEMPTED, EventKind.CAPACITY_ERROR):
            self.set_preemptive(event.location)
        elif event.kind is EventKind.LAUNCHED:
            self.set_active(event.location)
        # NOTICE: ignored, as shipped.

    def _cost(self, view: PolicyInput, loc: Location, market: Market) -> float:
        key = (loc, market)
        if key not in self._catalog_cost:
            price = view.price(loc, market)
            if price is None:  # not cached: a later price book may quote it
                return float("inf")
            self._catalog_cost[key] = price
        return self._catalog_cost[key]

    def select_next_location(self, view: PolicyInput, current: list[Location]) -> Location:
        active = self.active_locations()
        candidates = [loc for loc in active if loc not in current] or active
        return min(candidates, key=lambda loc: (self._cost(view, loc, Market.SPOT), loc))

    # --- the autoscaler (FallbackRequestRateAutoscaler) ---

    def _knobs(self, view: PolicyInput) -> tuple[int, bool, int]:
        over, dyn, base = self._overrides
        p = view.params
        return (
            p.num_overprovision if over is None else over,
            p.dynamic_ondemand_fallback if dyn is None else dyn,
            p.base_ondemand_fallback_replicas if base is None else base,
        )

    def decide(self, view: PolicyInput) -> Decision:
        self._know(view.locations)
        if self._early is not None:
            early, self._early = self._early, None
            for event in early:
                self.observe(event)
        overprovision, dynamic, base = self._knobs(view)
        decision = Decision()
        spot = view.by_market(Market.SPOT)
        if not view.params.use_spot:  # the service no longer wants spot: all on-demand
            decision.removals += [Removal(r.replica_id, "use_spot is off") for r in spot]
            spot = []
        on_demand = view.by_market(Market.ON_DEMAND)
        ready_spot = sum(1 for r in spot if _counts_ready(r))

        spot_goal = view.target + overprovision - base if view.params.use_spot else 0
        if len(spot) < spot_goal:
            current = [r.location for r in spot]
            for _ in range(spot_goal - len(spot)):
                loc = self.select_next_location(view, current)
                current.append(loc)
                decision.launches.append(Launch(loc, Market.SPOT, f"spot {len(current)}/{spot_goal}"))
        elif len(spot) > spot_goal:
            for r in _scale_down(spot, len(spot) - spot_goal):
                decision.removals.append(Removal(r.replica_id, f"spot above goal {spot_goal}"))

        od_goal = base + (max(0, spot_goal - ready_spot) if dynamic else 0)
        od_goal = min(od_goal, view.target)
        if not view.params.use_spot:
            od_goal = view.target
        if od_goal > len(on_demand):
            loc = min(view.locations, key=lambda loc: (self._cost(view, loc, Market.ON_DEMAND), loc))
            for _ in range(od_goal - len(on_demand)):
                decision.launches.append(
                    Launch(loc, Market.ON_DEMAND, f"fallback: {ready_spot} ready spot < {spot_goal}")
                )
        elif od_goal < len(on_demand):
            for r in _scale_down(on_demand, len(on_demand) - od_goal):
                decision.removals.append(Removal(r.replica_id, f"on-demand above goal {od_goal}"))
        return decision


def _counts_ready(r: ReplicaView) -> bool:
    # SkyServe does not see notices: a warned replica is still READY to it.
    return r.serving


def _scale_down(replicas: list[ReplicaView], n: int) -> list[ReplicaView]:
    # SkyServe never sees DRAINING; treat a warned replica as the phase it had.
    def as_skyserve(r: ReplicaView) -> ReplicaView:
        if r.phase is not Phase.DRAINING:
            return r
        return dataclasses.replace(r, phase=Phase.READY if r.ready_at is not None else Phase.LAUNCHING)

    by_id = {r.replica_id: r for r in replicas}
    ordered = scale_down_order(as_skyserve(r) for r in replicas)
    return [by_id[r.replica_id] for r in ordered[:n]]
