"""Baseline: spot replicas spread evenly, the next one where fewest run (NaiveSpread)."""

from __future__ import annotations

from policies.base import PolicyInput
from policies.common import price_map
from policies.spot_only import SpotOnlyPolicy
from providers.base import Location, Market


class EvenSpreadPolicy(SpotOnlyPolicy):
    name = "even_spread"
    description = "Baseline: next spot replica in the zone holding fewest (ties: cheapest, then first listed)"

    def pick(self, view: PolicyInput, current: list[Location]) -> Location:
        prices = price_map(view, Market.SPOT)
        # min() keeps the first of equals: ties go to the service's location order.
        return min(view.locations, key=lambda loc: (current.count(loc), prices.get(loc, float("inf"))))
