"""The shape every spot-only baseline shares: hold `target` spot replicas, no fallback.

Subclasses only say where the next one goes (`pick`); notices are ignored and a lost
replica is simply replaced, like the simulation baselines of SkyServe's paper.
"""

from __future__ import annotations

import abc

from policies.base import Decision, Launch, PlacementPolicy, PolicyInput, Removal
from policies.common import scale_down_order
from providers.base import Location, Market


class SpotOnlyPolicy(PlacementPolicy):
    @abc.abstractmethod
    def pick(self, view: PolicyInput, current: list[Location]) -> Location:
        """Where the next spot replica goes, given where the others are."""

    def decide(self, view: PolicyInput) -> Decision:
        decision = Decision()
        spot = view.by_market(Market.SPOT)
        current = [r.location for r in spot]
        for _ in range(view.target - len(spot)):
            loc = self.pick(view, current)
            current.append(loc)
            decision.launches.append(Launch(loc, Market.SPOT, f"{self.name}: spot {len(current)}/{view.target}"))
        for r in scale_down_order(spot)[: max(0, len(spot) - view.target)]:
            decision.removals.append(Removal(r.replica_id, f"spot above target {view.target}"))
        for r in view.by_market(Market.ON_DEMAND):  # a spot-only policy holds none
            decision.removals.append(Removal(r.replica_id, "spot-only policy"))
        return decision
