"""The PlacementPolicy interface, its value types and the plugin registry.

A policy decides where replicas run. The daemon's controller and the simulator call the
very same object, so a simulated result says something about the live system:

    policy.observe(event)          # every market event, in time order (preemption, notice, ...)
    decision = policy.decide(view) # the current replicas + price book -> launches/removals

A policy's only state is a fold over the events it was shown; the controller rebuilds it
from the events table after a restart by replaying them. `decide` must not do I/O.

Third-party policies register an entry point in group `spot_orchestrator.policies`
pointing at a PlacementPolicy subclass (or a zero-argument factory returning one).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Sequence
from importlib import metadata

from providers.base import Location, Market, Offers

ENTRY_POINT_GROUP = "spot_orchestrator.policies"
DEFAULT_POLICY = "hazard_hedge"


class Phase(str, enum.Enum):
    """What a policy needs to know of a replica's lifecycle state."""

    LAUNCHING = "launching"  # PENDING / PROVISIONING / STARTING: paid for, not serving yet
    READY = "ready"
    NOT_READY = "not_ready"  # was ready, failing probes
    DRAINING = "draining"  # has a notice: will die at its deadline, serves nothing new


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    replica_id: str
    location: Location
    market: Market
    phase: Phase
    launched_at: float
    notice_deadline: float | None = None
    # When the replica first became READY (None: never). A DRAINING replica that had been
    # ready still serves until its deadline; policies that ignore notices (SpotHedge) need
    # this to tell it from one that was still starting.
    ready_at: float | None = None

    @property
    def serving(self) -> bool:
        """Answers requests now: READY, or warned (DRAINING) but up since before the notice."""
        return self.phase is Phase.READY or (self.phase is Phase.DRAINING and self.ready_at is not None)


class EventKind(str, enum.Enum):
    LAUNCHED = "launched"
    READY = "ready"
    PREEMPTED = "preempted"  # the instance is gone (or its deadline passed)
    NOTICE = "notice"  # a preemption / rebalance warning arrived
    CAPACITY_ERROR = "capacity_error"  # a launch was refused for lack of capacity
    TERMINATED = "terminated"  # we removed it on purpose


@dataclasses.dataclass(frozen=True)
class MarketEvent:
    kind: EventKind
    location: Location
    market: Market
    at: float
    replica_id: str | None = None


@dataclasses.dataclass(frozen=True)
class ServiceParams:
    """The parts of the service spec a policy reads (SkyServe's replica_policy names)."""

    num_overprovision: int = 0
    base_ondemand_fallback_replicas: int = 0
    dynamic_ondemand_fallback: bool = False
    use_spot: bool = True
    accelerator: str | None = None
    accelerator_count: int = 1


@dataclasses.dataclass(frozen=True)
class PolicyInput:
    now: float
    target: int  # READY replicas the service wants (from the autoscaler)
    replicas: Sequence[ReplicaView]  # every live replica (terminal ones excluded)
    locations: Sequence[Location]  # where the service may run
    offers: Offers  # latest price book for those locations, both markets
    params: ServiceParams = ServiceParams()

    def by_market(self, market: Market) -> list[ReplicaView]:
        return [r for r in self.replicas if r.market is market]

    def price(self, location: Location, market: Market) -> float | None:
        quotes = [o.price_per_hour for o in self.offers if o.location == location and o.market is market]
        return min(quotes) if quotes else None


@dataclasses.dataclass(frozen=True)
class Launch:
    location: Location
    market: Market
    reason: str
    # The offer's instance type, when the policy chooses one; else the cheapest offer of the
    # service's accelerator there (orchestrator.fleet.decisions.offer_for).
    instance_type: str | None = None


@dataclasses.dataclass(frozen=True)
class Removal:
    replica_id: str
    reason: str


@dataclasses.dataclass
class Decision:
    launches: list[Launch] = dataclasses.field(default_factory=list)
    removals: list[Removal] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.launches or self.removals)


class PlacementPolicy(abc.ABC):
    name: str = "base"
    description: str = ""

    def observe(self, event: MarketEvent) -> None:  # noqa: B027 - stateless policies ignore events
        """Fold one market event into the policy's view of the world."""

    @abc.abstractmethod
    def decide(self, view: PolicyInput) -> Decision:
        """Which replicas to add and remove now, each with a reason."""


class UnknownPolicyError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; a user wants the plain line
        return str(self.args[0])


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_policies() -> dict[str, str]:
    """name -> one-line description, for every registered policy (the default marked)."""
    out: dict[str, str] = {}
    for name, ep in sorted(_entry_points().items()):
        try:
            out[name] = _instantiate(ep.load()).description or ""
        except Exception as err:  # a broken third-party plugin must not hide the others
            out[name] = f"(failed to load: {err})"
    return out


def _instantiate(obj: Callable[[], PlacementPolicy] | type[PlacementPolicy]) -> PlacementPolicy:
    policy = obj()
    if not isinstance(policy, PlacementPolicy):
        raise TypeError(f"{obj!r} did not produce a PlacementPolicy")
    return policy


def load_policy(name: str) -> PlacementPolicy:
    """A fresh policy instance by registered name; 'default' means the project's default."""
    if name == "default":
        name = DEFAULT_POLICY
    eps = _entry_points()
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise UnknownPolicyError(f"unknown policy {name!r}; registered policies: {known}")
    return _instantiate(eps[name].load())
