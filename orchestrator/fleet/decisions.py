"""The decision code the daemon's controller and the trace simulator share.

Both drive the same PlacementPolicy, and everything between the facts they observe and the
policy's inputs and outputs lives here, so a simulated result says something about the live
system: what the policy sees (`replica_view`, `price_book`, `policy_input`); what an observed fact
means, the replica's next state and the market event the policy learns from (`instance_gone`,
`notice_arrived`, `LAUNCH_GRANTED`, `launch_failed`, `became_ready`, `removed`); and how a Decision
is carried out (`plan`). Pure: no I/O, no clock, no store. The controller applies the outcomes to
store rows and the provider, the simulator to its in-memory replicas and the trace's capacities.
docs/lifecycle.md has the facts and their outcomes as a table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from orchestrator.spec import ServiceSpec
from orchestrator.fleet.lifecycle import ReplicaState, is_alive, phase_for_policy
from policies.base import (
    Decision,
    EventKind,
    Launch,
    PolicyInput,
    Removal,
    ReplicaView,
    ServiceParams,
)
from providers.base import CapacityError, Location, Market, Offer, Offers, ProviderError

S = ReplicaState


# ---- what the policy sees -------------------------------------------------------------


def replica_view(
    replica_id: str,
    location: Location,
    market: Market,
    state: ReplicaState,
    launched_at: float,
    notice_deadline: float | None = None,
    ready_at: float | None = None,
) -> ReplicaView | None:
    """The policy's view of one replica; None for one it must not count (shutting down or
    terminal)."""
    phase = phase_for_policy(state)
    if phase is None:
        return None
    return ReplicaView(replica_id, location, market, phase, launched_at, notice_deadline, ready_at)


def price_book(offers: Iterable, locations: Iterable[Location]) -> Offers:
    """The offers a policy may act on: those in the service's candidate locations."""
    return Offers(offers).in_locations(locations)


def policy_input(
    *,
    now: float,
    target: int,
    replicas: Iterable[ReplicaView | None],
    locations: Sequence[Location],
    offers: Offers,
    params: ServiceParams,
) -> PolicyInput:
    """What `decide` is given. `offers` must already be a `price_book` for `locations`
    (the simulator keeps one per price change instead of filtering at every step)."""
    return PolicyInput(
        now=now,
        target=target,
        replicas=[v for v in replicas if v is not None],
        locations=locations,
        offers=offers,
        params=params,
    )


# ---- what an observed fact means -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A fact's consequence: the replica's next state (None: unchanged) and the market
    event the policy must be shown (None: none; the fact says nothing about the market)."""

    state: ReplicaState | None = None
    event: EventKind | None = None


NOTHING = Outcome()
# States whose instance is not (yet, or any more) ours to watch: a launch in flight is
# settled by its own outcome, a removal by the shutdown that follows it.
_NOT_WATCHED = frozenset({S.PENDING, S.PROVISIONING, S.SHUTTING_DOWN})


def instance_gone(state: ReplicaState, market: Market) -> Outcome:
    """The replica's instance vanished (or the cloud reports it terminated) on its own."""
    if state in _NOT_WATCHED or not is_alive(state):
        return NOTHING
    if market is Market.SPOT or state is S.DRAINING:
        return Outcome(S.PREEMPTED, EventKind.PREEMPTED)  # reclaimed by the cloud
    return Outcome(S.FAILED)  # an on-demand instance exiting says nothing about the market


def notice_arrived(state: ReplicaState) -> Outcome:
    """A preemption / rebalance notice for the replica's instance."""
    if state in (S.STARTING, S.READY, S.NOT_READY, S.UNKNOWN):
        return Outcome(S.DRAINING, EventKind.NOTICE)
    # Already draining (a repeated notice), not running yet (its death will be observed),
    # or not alive: nothing new.
    return NOTHING


LAUNCH_GRANTED = Outcome(S.STARTING, EventKind.LAUNCHED)


def launch_failed(err: ProviderError) -> Outcome:
    """A launch request refused. Only a capacity refusal is a market fact; quota, auth and
    transient errors leave the policy's view of the market alone."""
    return Outcome(S.FAILED_PROVISION, EventKind.CAPACITY_ERROR if isinstance(err, CapacityError) else None)


def became_ready(state: ReplicaState) -> Outcome:
    """The replica's engine answers (its first successful readiness probe)."""
    if state is S.STARTING:
        return Outcome(S.READY, EventKind.READY)
    if state is S.DRAINING:
        # Warned while starting, it still comes up and serves until its deadline. The
        # daemon's probes skip DRAINING replicas, so only the simulator takes this branch.
        return Outcome(None, EventKind.READY)
    if state is S.NOT_READY:
        return Outcome(S.READY)  # recovered: the market learns nothing
    return NOTHING


def removed(state: ReplicaState) -> Outcome:
    """The policy removed the replica: it is terminated on purpose (a market event, so a
    policy can forget it)."""
    return Outcome(S.TERMINATED if state is S.PENDING else S.SHUTTING_DOWN, EventKind.TERMINATED)


# ---- carrying out a decision -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """A Decision in the order it is carried out: removals first (they free capacity a
    launch may need), then launches, each in the policy's order."""

    removals: list[Removal]
    launches: list[Launch]


def fits(offer: Offer, spec: ServiceSpec) -> bool:
    """Whether the offer's machine is one the spec accepts: its instance type, when it names
    one, and one of its (accelerator, count) pairs, when it names any."""
    if spec.resources.instance_type and offer.instance_type != spec.resources.instance_type:
        return False
    wanted = spec.accelerators_wanted()
    return not wanted or any(offer.accelerator.lower() == name.lower() and offer.accelerator_count == count
                             for name, count in wanted)


def offer_for(launch: Launch, offers: Offers, spec: ServiceSpec) -> Offer | None:
    """The offer a launch is carried out with: the cheapest one the spec accepts (of the
    instance type the policy named, if it named one) in the launch's location and market;
    None when there is no such offer."""
    here = Offers(o for o in offers if o.location == launch.location and o.market is launch.market
                  and fits(o, spec) and (not launch.instance_type or o.instance_type == launch.instance_type))
    return here.cheapest()


def plan(decision: Decision, state_of: Callable[[str], ReplicaState | None]) -> Plan:
    """The removals that still apply (the replica exists, is alive, named once) and the
    launches. `state_of(replica_id)` is the replica's current state, None if unknown."""
    removals, seen = [], set()
    for removal in decision.removals:
        if removal.replica_id in seen:
            continue
        state = state_of(removal.replica_id)
        if state is not None and is_alive(state):
            seen.add(removal.replica_id)
            removals.append(removal)
    return Plan(removals, list(decision.launches))
