"""The replica lifecycle: explicit states and the one table of allowed transitions.

Every state maps to the states it may go to, and every edge says in one line when it is taken
(VALID_TRANSITIONS, modelled on Ray autoscaler v2's instance manager). `transition()` refuses an
edge that is not in the table with IllegalTransition, so a controller bug shows up as an error
instead of a replica stuck in a state nobody expects. The store (orchestrator.control.store) calls
it on every state change and records the returned TransitionRecord as an event; the controller,
the simulator and orchestrator.fleet.decisions use the predicates. States are SkyServe's plus
DRAINING (noticed: serves nothing new, flushes its KV, dies at its deadline) and TERMINATED
(removed on purpose, its instance gone). docs/lifecycle.md has why, and what "terminal" means.
"""

from __future__ import annotations

import dataclasses
import enum
import time

from orchestrator.common.errors import UserError
from policies.base import Phase


class ReplicaState(str, enum.Enum):
    PENDING = "PENDING"
    PROVISIONING = "PROVISIONING"
    STARTING = "STARTING"
    READY = "READY"
    NOT_READY = "NOT_READY"
    DRAINING = "DRAINING"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    TERMINATED = "TERMINATED"
    FAILED = "FAILED"
    FAILED_INITIAL_DELAY = "FAILED_INITIAL_DELAY"
    FAILED_PROBING = "FAILED_PROBING"
    FAILED_PROVISION = "FAILED_PROVISION"
    FAILED_CLEANUP = "FAILED_CLEANUP"
    PREEMPTED = "PREEMPTED"
    UNKNOWN = "UNKNOWN"

    def __str__(self) -> str:
        return self.value


S = ReplicaState

# from-state -> {to-state: when this edge is taken}. The only place the lifecycle is defined.
VALID_TRANSITIONS: dict[ReplicaState, dict[ReplicaState, str]] = {
    S.PENDING: {
        S.PROVISIONING: "the controller sent the launch request to the provider",
        S.TERMINATED: "removed (scale-down or `down`) before any launch was attempted: nothing to clean",
        S.UNKNOWN: "the controller lost track of it (e.g. daemon restarted mid-reconcile)",
    },
    S.PROVISIONING: {
        S.STARTING: "the provider returned a running instance; the engine is booting",
        S.FAILED_PROVISION: "the launch failed (capacity, quota, auth or a persistent error)",
        S.PREEMPTED: "the cloud reclaimed the instance before the launch completed",
        S.SHUTTING_DOWN: "removed (scale-down or `down`) while the launch was in flight",
        S.UNKNOWN: "the launch outcome is unknown (daemon restarted mid-launch)",
    },
    S.STARTING: {
        S.READY: "the first readiness probe succeeded",
        S.FAILED_INITIAL_DELAY: "no probe succeeded within readiness_probe.initial_delay_seconds",
        S.FAILED: "the engine process or the instance exited on its own while starting",
        S.PREEMPTED: "the cloud reclaimed the instance while the engine was booting",
        S.DRAINING: "a preemption notice arrived while the engine was booting",
        S.SHUTTING_DOWN: "removed (scale-down, `down`, update) before it became ready",
        S.UNKNOWN: "the controller cannot observe the instance (provider API failing)",
    },
    S.READY: {
        S.NOT_READY: "a readiness probe failed or timed out",
        S.DRAINING: "a preemption notice arrived, or a graceful scale-down started",
        S.PREEMPTED: "the instance vanished without a notice (or past its deadline)",
        S.FAILED: "the engine process exited on its own",
        S.SHUTTING_DOWN: "removed at once (`down`, update, scale-down without drain)",
        S.UNKNOWN: "the controller cannot observe the instance (provider API failing)",
    },
    S.NOT_READY: {
        S.READY: "a readiness probe succeeded again",
        S.FAILED_PROBING: "probes kept failing for consecutive_failure_threshold_timeout",
        S.DRAINING: "a preemption notice arrived, or a graceful scale-down started",
        S.PREEMPTED: "the instance vanished without a notice (or past its deadline)",
        S.FAILED: "the engine process exited on its own",
        S.SHUTTING_DOWN: "removed at once (`down`, update, scale-down without drain)",
        S.UNKNOWN: "the controller cannot observe the instance (provider API failing)",
    },
    S.DRAINING: {
        S.SHUTTING_DOWN: "drained (in-flight requests moved, KV flushed) or the deadline came: terminate",
        S.PREEMPTED: "the cloud reclaimed the instance at (or before) the notice deadline",
        S.UNKNOWN: "the controller cannot observe the instance (provider API failing)",
    },
    S.SHUTTING_DOWN: {
        S.TERMINATED: "the provider confirmed the instance is gone",
        S.FAILED_CLEANUP: "terminating the instance kept failing; it may still be running (and billed)",
        S.UNKNOWN: "the controller cannot observe the instance (provider API failing)",
    },
    S.UNKNOWN: {
        S.STARTING: "re-observed: the instance runs, the engine has not answered a probe yet",
        S.READY: "re-observed: the instance runs and a probe succeeded",
        S.NOT_READY: "re-observed: the instance runs but probes fail",
        S.DRAINING: "re-observed with a pending preemption notice",
        S.PREEMPTED: "re-observed: the instance is gone",
        S.FAILED: "re-observed: the instance exists but its engine has exited",
        S.SHUTTING_DOWN: "removed while its state was unknown",
    },
    S.FAILED: {S.FAILED_CLEANUP: "terminating the failed replica's instance kept failing"},
    S.FAILED_INITIAL_DELAY: {S.FAILED_CLEANUP: "terminating the failed replica's instance kept failing"},
    S.FAILED_PROBING: {S.FAILED_CLEANUP: "terminating the failed replica's instance kept failing"},
    S.FAILED_PROVISION: {S.FAILED_CLEANUP: "a partly created instance could not be deleted"},
    S.PREEMPTED: {S.FAILED_CLEANUP: "deleting the preempted instance's leftovers kept failing"},
    S.TERMINATED: {},
    S.FAILED_CLEANUP: {},
}

TERMINAL_STATES: frozenset[ReplicaState] = frozenset(
    {
        S.TERMINATED,
        S.FAILED,
        S.FAILED_INITIAL_DELAY,
        S.FAILED_PROBING,
        S.FAILED_PROVISION,
        S.FAILED_CLEANUP,
        S.PREEMPTED,
    }
)

FAILED_STATES: frozenset[ReplicaState] = frozenset(s for s in TERMINAL_STATES if s.value.startswith("FAILED"))

_PHASES: dict[ReplicaState, Phase] = {
    S.PENDING: Phase.LAUNCHING,
    S.PROVISIONING: Phase.LAUNCHING,
    S.STARTING: Phase.LAUNCHING,
    S.READY: Phase.READY,
    S.NOT_READY: Phase.NOT_READY,
    # Unknown replicas still hold (and bill) capacity but serve nothing we can vouch for.
    S.UNKNOWN: Phase.NOT_READY,
    S.DRAINING: Phase.DRAINING,
}


class IllegalTransition(Exception):
    """An edge that is not in VALID_TRANSITIONS: a controller bug, never user input."""

    def __init__(self, current: ReplicaState, new: ReplicaState, reason: str = ""):
        allowed = ", ".join(s.value for s in VALID_TRANSITIONS[current]) or "none (final state)"
        super().__init__(f"illegal replica transition {current.value} -> {new.value} ({reason}); allowed: {allowed}")
        self.current = current
        self.new = new


@dataclasses.dataclass(frozen=True)
class TransitionRecord:
    from_state: ReplicaState
    to_state: ReplicaState
    reason: str  # why the controller took it (free text, e.g. "probe timed out after 15s")
    edge: str  # the table's one-line description of the edge
    at: float = dataclasses.field(default_factory=time.time)

    def message(self) -> str:
        return f"{self.from_state.value} -> {self.to_state.value}: {self.reason or self.edge}"


def parse_state(value: str | ReplicaState) -> ReplicaState:
    """The state named by `value` (case-insensitive); UserError naming the valid ones otherwise."""
    if isinstance(value, ReplicaState):
        return value
    try:
        return ReplicaState(str(value).upper())
    except ValueError:
        names = ", ".join(s.value for s in ReplicaState)
        raise UserError(f"unknown replica state {value!r}; expected one of {names}") from None


def can_transition(current: ReplicaState, new: ReplicaState) -> bool:
    return new in VALID_TRANSITIONS[current]


def transition(current: ReplicaState, new: ReplicaState, reason: str = "") -> TransitionRecord:
    """Validate one edge and describe it; raises IllegalTransition when it is not allowed."""
    edge = VALID_TRANSITIONS[current].get(new)
    if edge is None:
        raise IllegalTransition(current, new, reason)
    return TransitionRecord(from_state=current, to_state=new, reason=reason, edge=edge)


def is_terminal(state: ReplicaState) -> bool:
    """Never serves again and no policy counts it (its instance may still need cleanup)."""
    return state in TERMINAL_STATES


def is_failed(state: ReplicaState) -> bool:
    return state in FAILED_STATES


def is_alive(state: ReplicaState) -> bool:
    """Holds, or is about to hold, capacity the service counts (what the policy sees)."""
    return state in _PHASES


def is_serving(state: ReplicaState) -> bool:
    """The load balancer may send it new requests."""
    return state is S.READY


def phase_for_policy(state: ReplicaState) -> Phase | None:
    """The policy's coarse view of a state; None for replicas the policy must not count
    (SHUTTING_DOWN and terminal ones)."""
    return _PHASES.get(state)
