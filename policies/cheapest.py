"""Baseline: every replica on spot in the single cheapest zone (no spreading, no fallback)."""

from __future__ import annotations

from policies.base import PolicyInput
from policies.common import cheapest
from policies.spot_only import SpotOnlyPolicy
from providers.base import Location, Market


class CheapestZonePolicy(SpotOnlyPolicy):
    name = "cheapest"
    description = "Baseline: all replicas on spot in the cheapest zone, no fallback"

    def pick(self, view: PolicyInput, current: list[Location]) -> Location:
        loc = cheapest(view, Market.SPOT)
        assert loc is not None, "a service has at least one location"
        return loc
