"""Baseline: spot replicas placed on the zones in turn (SkyServe's RoundRobin), no fallback."""

from __future__ import annotations

from policies.base import PolicyInput
from policies.spot_only import SpotOnlyPolicy
from providers.base import Location


class RoundRobinPolicy(SpotOnlyPolicy):
    name = "round_robin"
    description = "Baseline: each new spot replica in the next zone in turn, no fallback"

    def __init__(self) -> None:
        self._next = 0  # launches so far: the cursor over the service's locations, in their order

    def pick(self, view: PolicyInput, current: list[Location]) -> Location:
        loc = view.locations[self._next % len(view.locations)]
        self._next += 1
        return loc
