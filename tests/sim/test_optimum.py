"""The offline optimum (a MILP solved by HiGHS) on traces small enough to solve by hand, and
its relation to the policies: nothing beats it."""

from __future__ import annotations

import pytest

from orchestrator.common.errors import UserError
from orchestrator.sim import optimum
from orchestrator.sim.paper import PaperConfig, simulate_paper
from orchestrator.sim.replay import SimConfig, simulate
from orchestrator.sim.traces import DEFAULT_SPOT_PRICES, load_groups
from policies.base import load_policy
from tests.sim.test_replay import write_trace

pytest.importorskip("scipy")


def test_one_zone_that_goes_away_is_bridged_by_on_demand_asked_a_cold_start_ahead(tmp_path):
    """Target 1, one zone with capacity 1,1,0,0,1,1 at 600 s ticks, cold start 120 s, a spot
    grant 30 s after the ask. Spot serves [120, 1200) (asked at 0); on-demand, asked at 1080,
    serves [1200, 2490); spot asked at 2370 is granted at 2400, when the zone has room again,
    and serves from 2490 to the end."""
    write_trace(tmp_path / "aws-one", "us-east-1a_v100_1", [1, 1, 0, 0, 1, 1])
    (group,) = load_groups(tmp_path / "aws-one")
    r = optimum.replay_optimum(group, SimConfig(target=1))
    spot = 1200 + (3600 - 2370)
    od = 2490 - 1080
    assert r.spot_gpu_hours * 3600 == pytest.approx(spot)
    assert r.on_demand_gpu_hours * 3600 == pytest.approx(od)
    assert r.cost_ratio == pytest.approx((spot + 3 * od) / (3 * 3600))
    assert (r.policy, r.availability) == ("optimal", 1.0)
    price = DEFAULT_SPOT_PRICES["v100_1"]
    assert r.cost == pytest.approx(price * (spot + 3 * od) / 3600)


def test_a_zone_never_holds_more_than_its_capacity_even_while_a_replica_starts(tmp_path):
    # Two zones of capacity 1, target 2: no spare room to start a replacement in the same zone,
    # so when a's capacity moves to b... there is none: b is full. On-demand bridges.
    write_trace(tmp_path / "aws-two", "us-east-1a_v100_1", [1, 1, 1, 1])
    write_trace(tmp_path / "aws-two", "us-east-1b_v100_1", [1, 1, 1, 1])
    (group,) = load_groups(tmp_path / "aws-two")
    r = optimum.replay_optimum(group, SimConfig(target=2))
    assert r.on_demand_gpu_hours == 0 and r.spot_gpu_hours * 3600 == pytest.approx(2 * 2400)
    r3 = optimum.replay_optimum(group, SimConfig(target=3))
    assert r3.on_demand_gpu_hours * 3600 == pytest.approx(2400)  # the third replica: on-demand throughout


def test_no_policy_beats_the_optimum(tmp_path):
    write_trace(tmp_path / "aws-p", "us-east-1a_v100_1", [1, 1, 0, 1, 1, 0, 0, 1] * 3, gap=300)
    write_trace(tmp_path / "aws-p", "us-east-1b_v100_1", [0, 1, 1, 1, 0, 0, 1, 1] * 3, gap=300)
    write_trace(tmp_path / "aws-p", "us-east-1c_v100_1", [1, 0, 1, 1, 1, 1, 0, 1] * 3, gap=300)
    (group,) = load_groups(tmp_path / "aws-p")
    best = optimum.replay_optimum(group, SimConfig()).cost_ratio
    paper = PaperConfig(windows=2, window_hours=1.0)
    best_paper = optimum.paper_optimum(group, paper).cost_ratio
    for name in ("spothedge", "default", "ondemand"):
        assert simulate(group, load_policy(name), SimConfig()).cost_ratio >= best - 1e-9
        r = simulate_paper(group, lambda name=name: load_policy(name), paper)
        assert r.availability < 1.0 or r.cost_ratio >= best_paper - 1e-9


def test_a_missing_solver_is_a_one_line_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_scipy(name, *args, **kwargs):
        if name.startswith("scipy"):
            raise ImportError("No module named 'scipy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_scipy)
    with pytest.raises(UserError, match=r"needs scipy: pip install 'spot-orchestrator\[optimum\]'"):
        optimum.solve([[1]], [[1.0]], 60.0, 30.0, 1, 3.0)
