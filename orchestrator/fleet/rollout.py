"""An update's next step: which replicas of an older launch revision to hide from the policy
and which to retire now, never taking the READY count below the target.

Pure: the controller calls `step()` on every reconcile pass while its service's row names an
update mode, with the live replicas it observed, and carries the step out (the policy decides
without the hidden replicas, so it launches their replacements where it likes; the retired ones
are drained, their streams migrated, and terminated). Level-triggered like the rest of the
controller: nothing but the replica rows and the mode is remembered between passes.
docs/lifecycle.md ("Updating a service") walks through both modes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from orchestrator.fleet.lifecycle import ReplicaState, is_alive

S = ReplicaState
ROLLING, BLUE_GREEN = "rolling", "blue-green"
MODES = (ROLLING, BLUE_GREEN)
# Old replicas replaced at a time in a rolling update: one new replica above the target at most.
MAX_SURGE = 1
_LEAVING = frozenset({S.DRAINING, S.SHUTTING_DOWN})


@dataclasses.dataclass(frozen=True)
class Member:
    """What the step needs of one replica."""

    replica_id: str
    state: ReplicaState
    revision: str | None


@dataclasses.dataclass(frozen=True)
class Step:
    hidden: frozenset[str]  # old replicas the policy must not count: they are being replaced
    retire: tuple[str, ...]  # old replicas to drain, migrate and terminate now
    old: int  # live replicas of an older revision (retiring ones included)
    new: int  # live replicas of the current revision
    done: bool  # no replica of an older revision is left


def step(members: Iterable[Member], revision: str, target: int, mode: str = ROLLING,
         max_surge: int = MAX_SURGE) -> Step:
    """The next step of an update to `revision` with `target` replicas wanted READY."""
    if mode not in MODES:
        raise ValueError(f"update mode {mode!r}: expected one of {', '.join(MODES)}")
    live = [m for m in members if is_alive(m.state)]
    old = [m for m in live if m.revision != revision]
    new = [m for m in live if m.revision == revision]
    leaving = [m for m in old if m.state in _LEAVING]
    # Those serving nothing go first: retiring them costs no READY replica.
    staying = sorted((m for m in old if m.state not in _LEAVING), key=lambda m: m.state is S.READY)
    ready = sum(1 for m in live if m.state is S.READY)
    if mode == BLUE_GREEN:
        batch = staying  # the whole new set comes up beside the old one
        new_ready = sum(1 for m in new if m.state is S.READY)
        retire = [m for m in batch if m.state is not S.READY or new_ready >= target]
    else:
        batch = staying[:max(1, max_surge)]
        retire, spare = [], ready - target
        for m in batch:
            if m.state is not S.READY:
                retire.append(m)
            elif spare >= 1:  # the others stay at the target without it
                retire.append(m)
                spare -= 1
    return Step(
        hidden=frozenset(m.replica_id for m in (*leaving, *batch)),
        retire=tuple(m.replica_id for m in retire),
        old=len(old),
        new=len(new),
        done=not old,
    )
