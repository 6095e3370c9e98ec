"""orchestrator.fleet.rollout: an update's steps, driven pass after pass against a stand-in
policy (it launches what the visible replicas lack; a launch is READY the pass after), the way
the controller drives it: never fewer READY than the target, every old replica replaced."""

from __future__ import annotations

import itertools

import pytest

from orchestrator.fleet import rollout
from orchestrator.fleet.lifecycle import ReplicaState

S = ReplicaState


def drive(mode: str, target: int, old: int, max_passes: int = 50):
    """Pass by pass: (the READY count seen at every pass, the pass log of (retired, launched))."""
    ids = itertools.count(1)
    fleet = {f"r{next(ids)}": [S.READY, "v1"] for _ in range(old)}
    ready_seen, log = [], []
    for _ in range(max_passes):
        ready_seen.append(sum(1 for state, _rev in fleet.values() if state is S.READY))
        members = [rollout.Member(rid, state, rev) for rid, (state, rev) in fleet.items()]
        step = rollout.step(members, "v2", target, mode)
        if step.done:
            return ready_seen, log
        for rid in list(fleet):  # last pass's retirements are gone; last pass's launches READY
            if fleet[rid][0] is S.DRAINING:
                del fleet[rid]
            elif fleet[rid][0] is S.STARTING:
                fleet[rid][0] = S.READY
        for rid in step.retire:
            fleet[rid][0] = S.DRAINING
        visible = [rid for rid in fleet if rid not in step.hidden and fleet[rid][0] is not S.DRAINING]
        launched = [f"r{next(ids)}" for _ in range(max(0, target - len(visible)))]
        for rid in launched:
            fleet[rid] = [S.STARTING, "v2"]
        log.append((step.retire, tuple(launched)))
    raise AssertionError(f"no end after {max_passes} passes: {fleet}")


def test_rolling_replaces_one_at_a_time_never_below_the_target():
    ready_seen, log = drive(rollout.ROLLING, target=3, old=3)
    assert min(ready_seen) >= 3
    assert all(len(retired) <= 1 and len(launched) <= 1 for retired, launched in log)
    assert sum(len(retired) for retired, _ in log) == 3


def test_blue_green_launches_the_whole_set_before_retiring_any():
    ready_seen, log = drive(rollout.BLUE_GREEN, target=3, old=3)
    assert min(ready_seen) >= 3
    first_retire = next(i for i, (retired, _) in enumerate(log) if retired)
    assert sum(len(launched) for _, launched in log[:first_retire]) == 3
    assert len(log[first_retire][0]) == 3  # the old set goes at once


def test_an_old_replica_that_serves_nothing_goes_first_and_at_once():
    members = [rollout.Member("a", S.READY, "v1"), rollout.Member("b", S.STARTING, "v1"),
               rollout.Member("c", S.READY, "v2")]
    step = rollout.step(members, "v2", target=2)
    assert step.retire == ("b",) and step.hidden == {"b"}
    assert (step.old, step.new, step.done) == (2, 1, False)


def test_nothing_old_is_done_and_a_bad_mode_is_refused():
    step = rollout.step([rollout.Member("a", S.READY, "v2"), rollout.Member("b", S.TERMINATED, "v1")], "v2", 1)
    assert step.done and not step.retire and not step.hidden
    with pytest.raises(ValueError, match="blue-green"):
        rollout.step([], "v2", 1, "sideways")
