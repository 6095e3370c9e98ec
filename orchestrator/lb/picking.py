"""How the load balancer chooses a replica: pure functions of the candidates and their loads.

SkyServe's two policies: `least_load` (fewest requests in flight, default) and `round_robin`.
orchestrator.lb.proxy makes one picker per load balancer (`make_picker`). Both are deterministic
given their inputs, so tests can assert exact placements.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Protocol

from orchestrator.common.errors import UserError


class ReplicaPicker(Protocol):
    def pick(self, candidates: Sequence[str], in_flight: Mapping[str, int]) -> str:
        """One of `candidates` (never empty) for the next request."""


class RoundRobin:
    """Cycle through the candidates in order, whatever their load."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[str], in_flight: Mapping[str, int]) -> str:
        return candidates[next(self._counter) % len(candidates)]


class LeastLoad:
    """Fewest requests in flight; ties rotate so equally idle replicas share the work
    (always taking the first idle one would send every sequential request to one replica)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[str], in_flight: Mapping[str, int]) -> str:
        lowest = min(in_flight.get(c, 0) for c in candidates)
        idle = [c for c in candidates if in_flight.get(c, 0) == lowest]
        return idle[next(self._counter) % len(idle)]


POLICIES: dict[str, type[ReplicaPicker]] = {"least_load": LeastLoad, "round_robin": RoundRobin}


def make_picker(policy: str) -> ReplicaPicker:
    """A fresh picker for `policy`; UserError naming the known policies for any other name."""
    try:
        return POLICIES[policy]()
    except KeyError:
        names = ", ".join(sorted(POLICIES))
        raise UserError(f"load_balancing_policy: unknown policy {policy!r}, expected one of {names}") from None
