"""Baseline: every replica on-demand in the cheapest on-demand location (the cost yardstick)."""

from __future__ import annotations

from policies.base import Decision, Launch, PlacementPolicy, PolicyInput, Removal
from policies.common import cheapest, scale_down_order
from providers.base import Market


class OnDemandPolicy(PlacementPolicy):
    name = "ondemand"
    description = "Baseline: all replicas on-demand in the cheapest location (cost ratio 1.0)"

    def decide(self, view: PolicyInput) -> Decision:
        decision = Decision()
        held = view.by_market(Market.ON_DEMAND)
        loc = cheapest(view, Market.ON_DEMAND)
        assert loc is not None, "a service has at least one location"
        for _ in range(view.target - len(held)):
            decision.launches.append(Launch(loc, Market.ON_DEMAND, "on-demand only"))
        for r in scale_down_order(held)[: max(0, len(held) - view.target)]:
            decision.removals.append(Removal(r.replica_id, f"above target {view.target}"))
        for r in view.by_market(Market.SPOT):
            decision.removals.append(Removal(r.replica_id, "on-demand only"))
        return decision
