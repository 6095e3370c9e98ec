"""The replica state machine: every edge of the table works, every other pair is refused."""

from __future__ import annotations

import itertools

import pytest

from orchestrator.common.errors import UserError
from orchestrator.fleet.lifecycle import (
    TERMINAL_STATES,
    VALID_TRANSITIONS,
    IllegalTransition,
    ReplicaState,
    can_transition,
    is_alive,
    is_serving,
    is_terminal,
    parse_state,
    phase_for_policy,
    transition,
)
from policies.base import Phase

S = ReplicaState
LEGAL = [(a, b) for a, targets in VALID_TRANSITIONS.items() for b in targets]
ILLEGAL = [(a, b) for a, b in itertools.product(ReplicaState, ReplicaState) if b not in VALID_TRANSITIONS[a]]


def test_table_covers_every_state_and_describes_every_edge():
    assert set(VALID_TRANSITIONS) == set(ReplicaState)
    for src, targets in VALID_TRANSITIONS.items():
        for dst, why in targets.items():
            assert isinstance(dst, ReplicaState)
            assert why.strip() and "\n" not in why, f"{src}->{dst} needs a one-line reason"
    # the SkyServe states are all there, plus ours
    skyserve = {
        "PENDING", "PROVISIONING", "STARTING", "READY", "NOT_READY", "SHUTTING_DOWN", "FAILED",
        "FAILED_INITIAL_DELAY", "FAILED_PROBING", "FAILED_PROVISION", "FAILED_CLEANUP", "PREEMPTED", "UNKNOWN",
    }  # fmt: skip
    assert skyserve | {"DRAINING", "TERMINATED"} == {s.value for s in ReplicaState}


@pytest.mark.parametrize(("src", "dst"), LEGAL, ids=[f"{a.value}->{b.value}" for a, b in LEGAL])
def test_legal_transition(src, dst):
    record = transition(src, dst, "because")
    assert (record.from_state, record.to_state, record.reason) == (src, dst, "because")
    assert record.edge == VALID_TRANSITIONS[src][dst]
    assert record.message() == f"{src.value} -> {dst.value}: because"
    assert can_transition(src, dst)


def test_every_illegal_pair_raises():
    assert len(LEGAL) + len(ILLEGAL) == len(ReplicaState) ** 2
    for src, dst in ILLEGAL:
        assert not can_transition(src, dst)
        with pytest.raises(IllegalTransition) as info:
            transition(src, dst, "test")
        assert info.value.current is src and info.value.new is dst
        assert f"{src.value} -> {dst.value}" in str(info.value)


def test_no_self_loops_and_final_states_have_no_exit():
    for state in ReplicaState:
        assert not can_transition(state, state)
    assert VALID_TRANSITIONS[S.TERMINATED] == {} and VALID_TRANSITIONS[S.FAILED_CLEANUP] == {}
    # a terminal state never goes back to serving: at most to FAILED_CLEANUP
    for state in TERMINAL_STATES:
        assert set(VALID_TRANSITIONS[state]) <= {S.FAILED_CLEANUP}


def test_every_state_is_reachable_from_pending():
    seen, frontier = {S.PENDING}, [S.PENDING]
    while frontier:
        for nxt in VALID_TRANSITIONS[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(ReplicaState)


def test_every_non_final_state_can_reach_a_final_state():
    final = {s for s, t in VALID_TRANSITIONS.items() if not t}
    for start in ReplicaState:
        seen, frontier = {start}, [start]
        while frontier:
            for nxt in VALID_TRANSITIONS[frontier.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        assert seen & final, start


def test_predicates_and_policy_phases():
    assert phase_for_policy(S.PENDING) is Phase.LAUNCHING
    assert phase_for_policy(S.STARTING) is Phase.LAUNCHING
    assert phase_for_policy(S.READY) is Phase.READY
    assert phase_for_policy(S.NOT_READY) is Phase.NOT_READY
    assert phase_for_policy(S.DRAINING) is Phase.DRAINING
    assert phase_for_policy(S.SHUTTING_DOWN) is None
    for state in ReplicaState:
        # the policy counts exactly the alive states, and never a terminal one
        assert (phase_for_policy(state) is not None) == is_alive(state)
        assert not (is_alive(state) and is_terminal(state))
    assert [s for s in ReplicaState if is_serving(s)] == [S.READY]
    assert is_terminal(S.PREEMPTED) and is_terminal(S.FAILED_PROBING) and not is_terminal(S.DRAINING)


def test_parse_state():
    assert parse_state("ready") is S.READY
    assert parse_state(S.DRAINING) is S.DRAINING
    with pytest.raises(UserError, match="unknown replica state 'redy'"):
        parse_state("redy")
