"""The trace simulator's accounting and trace handling, on small traces worked out by hand."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.common.errors import UserError
from orchestrator.sim.replay import SimConfig, run_matrix, simulate
from orchestrator.sim.traces import (
    DEFAULT_SPOT_PRICES,
    cloud_part,
    expand_trace_dirs,
    load_groups,
    load_price_table,
    merge_groups,
)
from policies.base import Decision, EventKind, MarketEvent, Phase, PlacementPolicy, PolicyInput
from policies.cheapest import CheapestZonePolicy
from policies.ondemand import OnDemandPolicy

REPO = Path(__file__).resolve().parents[2]
SPOTCTL = REPO / ".venv" / "bin" / "spotctl"


def write_trace(folder: Path, name: str, data: list[int], gap: int = 600, prices: list[float] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    doc: dict = {"metadata": {"gap_seconds": gap}, "data": data}
    if prices is not None:
        doc["prices"] = prices
    path = folder / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


class Recorder(PlacementPolicy):
    """Wraps a policy and keeps every event and view it was shown."""

    def __init__(self, inner: PlacementPolicy):
        self.inner, self.name = inner, inner.name
        self.events: list[MarketEvent] = []
        self.views: list[PolicyInput] = []

    def observe(self, event: MarketEvent) -> None:
        self.events.append(event)
        self.inner.observe(event)

    def decide(self, view: PolicyInput) -> Decision:
        self.views.append(view)
        return self.inner.decide(view)

    def times(self, kind: EventKind) -> list[float]:
        return [e.at for e in self.events if e.kind is kind]


def test_all_on_demand_costs_exactly_one_and_is_always_available(tmp_path):
    folder = tmp_path / "aws-test"
    write_trace(folder, "us-east-1a_v100_1", [1, 0, 1, 0, 0, 1], gap=300)
    write_trace(folder, "us-east-1b_v100_1", [0, 0, 1, 1, 0, 1], gap=300, prices=[0.5] * 6)
    (group,) = load_groups(folder)
    r = simulate(group, OnDemandPolicy(), SimConfig(target=3))
    assert r.cost_ratio == pytest.approx(1.0, abs=1e-12)
    assert r.availability == 1.0
    assert r.preemptions == 0 and r.launches == 3 and r.spot_gpu_hours == 0
    assert r.on_demand_gpu_hours == pytest.approx(3 * 6 * 300 / 3600)
    # The baseline is the cheapest zone's on-demand price: 3 x 0.5 (us-east-1b's prices).
    assert r.on_demand_baseline_cost == pytest.approx(3 * 1.5 * 1800 / 3600)


def test_preemption_notice_capacity_errors_and_cost_by_hand(tmp_path):
    """One zone, target 1: capacity 1,1,0,0,1,1 at 600 s ticks, notice 120, cold start 120,
    a spot launch granted or refused 30 s after it is asked for."""
    folder = tmp_path / "aws-one"
    write_trace(folder, "us-east-1a_v100_1", [1, 1, 0, 0, 1, 1])
    (group,) = load_groups(folder)
    rec = Recorder(CheapestZonePolicy())
    r = simulate(group, rec, SimConfig(target=1))

    assert rec.times(EventKind.LAUNCHED)[0] == 30.0
    assert rec.times(EventKind.READY)[0] == 120.0
    # The drop at tick 2 (1200 s) is announced 120 s ahead, then the replica is gone.
    assert rec.times(EventKind.NOTICE) == [1080.0]
    assert rec.times(EventKind.PREEMPTED) == [1200.0]
    warned = [v for v in rec.views if v.now == 1080.0][0]
    assert [(x.phase, x.notice_deadline) for x in warned.replicas] == [(Phase.DRAINING, 1200.0)]
    # Relaunched at 1200 and every 30 s after a refusal, until the zone grants at tick 4.
    refusals = rec.times(EventKind.CAPACITY_ERROR)
    assert refusals[0] == 1230.0 and refusals[-1] == 2370.0 and len(refusals) == 39
    assert rec.times(EventKind.LAUNCHED)[1] == 2400.0
    assert rec.times(EventKind.READY)[1] == 2370.0 + 120.0
    assert (r.preemptions, r.capacity_errors, r.launches, r.notices) == (1, 39, 41, 1)
    assert r.launches_per_preemption == 1.0  # one granted relaunch for one replica lost
    # Up from 120 to 1200 and from 2490 to the end (3600): availability over [120, 3600).
    assert r.availability == pytest.approx((1080 + 1110) / 3480)
    # Billed from the ask until the end: [0, 1200] and [2370, 3600]; refused asks cost nothing.
    price = DEFAULT_SPOT_PRICES["v100_1"]
    assert r.cost == pytest.approx(price * (1200 + 1230) / 3600)
    assert r.cost_ratio == pytest.approx((1200 + 1230) / (3 * 3600))
    assert r.spot_gpu_hours == pytest.approx((1200 + 1230) / 3600)


@pytest.mark.parametrize("folder, notice", [("gcp-x", 30.0), ("azure-x", 30.0), ("aws-x", 120.0), ("mine", 120.0)])
def test_the_notice_is_the_trace_clouds_unless_configured(tmp_path, folder, notice):
    write_trace(tmp_path / folder, "us-east-1a_v100_1", [1, 1, 0, 0])
    (group,) = load_groups(tmp_path / folder)
    rec = Recorder(CheapestZonePolicy())
    r = simulate(group, rec, SimConfig(target=1))
    assert r.notice_s == notice and rec.times(EventKind.NOTICE) == [1200.0 - notice]
    assert simulate(group, CheapestZonePolicy(), SimConfig(target=1, notice=0.0)).notices == 0


def test_replica_that_comes_up_inside_the_notice_window_is_warned_at_once(tmp_path):
    folder = tmp_path / "aws-late"
    # Capacity ends at tick 1 (600 s): the first ask at 0 is granted at 30, already inside
    # no window; at 600 - 120 = 480 it is warned. A notice of 700 s covers the grant itself.
    write_trace(folder, "us-east-1a_v100_1", [1, 0, 0])
    (group,) = load_groups(folder)
    rec = Recorder(CheapestZonePolicy())
    simulate(group, rec, SimConfig(target=1, notice=700))
    assert rec.times(EventKind.LAUNCHED)[0] == 30.0
    assert rec.times(EventKind.NOTICE) == [30.0]  # at the grant: the drop is 570 s away
    assert rec.times(EventKind.PREEMPTED) == [600.0]


def test_preempts_newest_first_when_a_multi_node_zone_shrinks(tmp_path):
    folder = tmp_path / "aws-multi"
    write_trace(folder, "us-east-1a_v100_1", [4, 4, 1, 1], gap=600)
    (group,) = load_groups(folder)

    class ThreeHere(CheapestZonePolicy):
        def decide(self, view):
            # Ask one at a time so the replicas have distinct ages.
            d = super().decide(view)
            d.launches = d.launches[:1]
            return d

    rec = Recorder(ThreeHere())
    r = simulate(group, rec, SimConfig(target=3, notice=0))
    preempted = [e.replica_id for e in rec.events if e.kind is EventKind.PREEMPTED]
    assert r.preemptions == 2 and preempted and "r000001" not in preempted  # the oldest survives


def test_trace_groups_split_mixed_kinds_and_replay_the_common_prefix(tmp_path):
    folder = tmp_path / "aws-mixed"
    write_trace(folder, "us-west-2a_v100_1", [1] * 10)
    write_trace(folder, "us-west-2b_v100_1", [1] * 7)
    write_trace(folder, "us-west-2a_k80_8", [0, 1, 1])
    groups = {g.kind: g for g in load_groups(folder)}
    assert sorted(groups) == ["k80_8", "v100_1"]
    assert groups["v100_1"].ticks == 7 and len(groups["v100_1"].zones) == 2
    assert groups["k80_8"].gpus_per_replica == 8 and groups["v100_1"].gpus_per_replica == 1
    loc = groups["v100_1"].zones[0].location
    assert (loc.cloud, loc.region, loc.zone) == ("aws", "us-west-2", "us-west-2a")
    (gcp,) = load_groups(write_trace(tmp_path / "gcp-x", "us-central1-a_c3-88", [1]).parent)
    assert gcp.zones[0].location.region == "us-central1" and gcp.zones[0].location.cloud == "gcp"


def test_prices_from_trace_then_price_file_then_defaults(tmp_path):
    folder = tmp_path / "aws-p"
    write_trace(folder, "us-east-1a_v100_1", [1, 1], prices=[0.4, None])
    write_trace(folder, "us-east-1b_v100_1", [1, 1])
    write_trace(folder, "us-east-1c_v100_1", [1, 1])
    table = tmp_path / "prices.json"
    table.write_text(json.dumps({"us-east-1b": 0.7}))
    (group,) = load_groups(folder, load_price_table(table))
    prices = {z.location.zone: z.spot_prices for z in group.zones}
    assert prices == {"us-east-1a": [0.4, 0.4], "us-east-1b": [0.7, 0.7], "us-east-1c": [0.918, 0.918]}


def test_directory_of_groups_expands_to_every_group(tmp_path):
    write_trace(tmp_path / "root" / "a" / "aws-1", "us-east-1a_v100_1", [1])
    write_trace(tmp_path / "root" / "b" / "aws-2", "us-east-1a_v100_1", [1])
    found = [f.name for f, _ in expand_trace_dirs([tmp_path / "root"])]
    assert found == ["aws-1", "aws-2"]
    results = run_matrix([tmp_path / "root"], ["ondemand"], SimConfig(target=1))
    assert [r.trace for r in results] == ["a/aws-1", "b/aws-2"]


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, r"no \*\.json"),
        (lambda d: (d / "us-east-1a_v100_1.json").write_text("{not json"), "malformed JSON"),
        (lambda d: (d / "us-east-1a_v100_1.json").write_text('{"data": [1]}'), "gap_seconds"),
        (lambda d: (d / "us-east-1a_v100_1.json").write_text('{"metadata": {"gap_seconds": 5}, "data": [-1]}'),
         "integers >= 0"),
        (lambda d: (d / "nounderscore.json").write_text('{"metadata": {"gap_seconds": 5}, "data": [1]}'),
         "ZONE_KIND"),
    ],
)
def test_bad_traces_are_one_line_user_errors(tmp_path, setup, message):
    folder = tmp_path / "aws-bad"
    folder.mkdir()
    setup(folder)
    with pytest.raises(UserError, match=message) as err:
        load_groups(folder)
    assert "\n" not in str(err.value)


def test_missing_folder_and_unknown_policy(tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        run_matrix([tmp_path / "nope"], ["ondemand"], SimConfig())
    write_trace(tmp_path / "aws-ok", "us-east-1a_v100_1", [1])
    with pytest.raises(UserError, match="unknown policy 'nope'"):
        run_matrix([tmp_path / "aws-ok"], ["nope"], SimConfig())


def _spotctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SPOTCTL), *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


@pytest.mark.skipif(not SPOTCTL.exists(), reason=f"{SPOTCTL} missing: install the project into .venv")
def test_cli_json_plot_and_errors(tmp_path):
    folder = tmp_path / "aws-cli"
    write_trace(folder, "us-east-1a_v100_1", [1, 1, 0, 1, 1, 1])
    write_trace(folder, "us-east-1b_v100_1", [1, 0, 1, 1, 0, 1])
    plot = tmp_path / "out.png"
    out = _spotctl("simulate", "--trace", str(folder), "--policy", "spothedge,default", "--policy", "ondemand",
                   "--target", "1", "--json", "--plot", str(plot))
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["policy"] for r in rows] == ["spothedge", "hazard_hedge", "ondemand"]
    keys = {"policy", "trace", "cost_ratio", "availability", "spot_gpu_hours", "on_demand_gpu_hours",
            "preemptions", "launches", "launches_per_preemption", "notice_s", "model"}
    assert all(keys <= set(r) for r in rows)
    assert rows[2]["cost_ratio"] == pytest.approx(1.0)
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    paper = _spotctl("simulate", "--model", "spothedge-paper", "--trace", str(folder), "--policy", "spothedge",
                     "--windows", "2", "--target", "1", "--optimal", "--json")
    assert paper.returncode == 0, paper.stderr
    rows = json.loads(paper.stdout)
    assert [(r["policy"], r["model"]) for r in rows] == [("spothedge", "spothedge-paper"),
                                                         ("optimal", "spothedge-paper")]
    assert rows[1]["cost_ratio"] <= rows[0]["cost_ratio"] and rows[1]["availability"] == 1.0

    table = _spotctl("simulate", "--trace", str(folder), "--policy", "ondemand")
    assert table.returncode == 0 and "ondemand" in table.stdout and "1.000" in table.stdout

    for args, needle in [
        (("--trace", str(tmp_path / "missing"), "--policy", "ondemand"), "no such directory"),
        (("--trace", str(folder), "--policy", "nope"), "unknown policy"),
        (("--trace", str(folder), "--policy", "ondemand", "--target", "0"), "--target"),
        (("--trace", str(folder), "--policy", "ondemand", "--model", "bogus"), "--model must be one of"),
        (("--trace", str(folder), "--model", "spothedge-paper", "--notice", "5"), "--notice does not apply"),
        (("--trace", str(folder), "--zone-order", "us-east-1a"), "--zone-order applies to"),
    ]:
        bad = _spotctl("simulate", *args)
        assert bad.returncode == 2, bad.stderr
        assert needle in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert "Traceback" not in bad.stderr


# spotctl without matplotlib: a None entry in sys.modules makes its import raise ImportError.
_WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = sys.modules["matplotlib.pyplot"] = None
from orchestrator.cli.app import main
sys.argv = ["spotctl", *sys.argv[1:]]
main()
"""


def test_plot_without_the_plot_extra_is_a_one_line_error(tmp_path):
    import sys

    folder = tmp_path / "aws-cli"
    write_trace(folder, "us-east-1a_v100_1", [1, 1, 0, 1])
    plot = tmp_path / "out.png"
    args = ["simulate", "--trace", str(folder), "--policy", "ondemand", "--target", "1"]
    out = subprocess.run([sys.executable, "-c", _WITHOUT_MATPLOTLIB, *args, "--plot", str(plot)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "error: install the plot extra: pip install 'spot-orchestrator[plot]'", out.stderr
    assert not plot.exists() and out.stdout == ""
    # Without --plot the same interpreter simulates as usual: only the plot needs the extra.
    out = subprocess.run([sys.executable, "-c", _WITHOUT_MATPLOTLIB, *args, "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and json.loads(out.stdout)[0]["policy"] == "ondemand", out.stderr

def test_two_clouds_replay_as_one_market_each_zone_with_its_cloud_notice_and_price(tmp_path):
    """An AWS trace (60 s samples, a dear zone) and a GCP one (30 s, cheap): one market on
    30 s samples, cut to the shorter span; a replica is warned as long ahead as its own
    cloud warns, and the cheapest policy goes where the price is lowest, whatever the cloud."""
    write_trace(tmp_path / "aws-a", "us-east-1a_v100_1", [1] * 10, gap=60, prices=[2.0] * 10)
    write_trace(tmp_path / "gcp-b", "us-central1-a_v100_1", [1] * 12 + [0] * 8, gap=30, prices=[0.5] * 20)
    (aws,) = load_groups(tmp_path / "aws-a")
    (gcp,) = load_groups(tmp_path / "gcp-b")
    market = merge_groups([aws, gcp])
    assert market.clouds == ["aws", "gcp"] and market.gap == 30 and market.ticks == 20
    assert [z.location.cloud for z in market.zones] == ["aws", "gcp"]
    assert market.zones[0].capacity == [1] * 20 and market.zones[0].spot_prices == [2.0] * 20
    rec = Recorder(CheapestZonePolicy())
    r = simulate(market, rec, SimConfig(target=1))
    launched = [e for e in rec.events if e.kind is EventKind.LAUNCHED]
    assert launched[0].location.cloud == "gcp"  # the cheapest zone, on the other cloud
    # GCP's capacity ends at 360 s: its replica is warned GCP's 30 s ahead, not AWS's 120.
    notices = [e for e in rec.events if e.kind is EventKind.NOTICE]
    assert [(e.location.cloud, e.at) for e in notices] == [("gcp", 330.0)]
    assert r.notice_s == 30.0  # the shortest notice in the market
    assert cloud_part(market, "aws").zones == market.zones[:1]
    with pytest.raises(UserError, match="at least two"):
        merge_groups([aws])
    with pytest.raises(UserError, match="appears in two"):
        merge_groups([aws, aws])

    out = _spotctl("simulate", "--trace", str(tmp_path / "aws-a"), "--trace", str(tmp_path / "gcp-b"),
                   "--one-market", "--policy", "spothedge,default", "--target", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["trace"], r["policy"]) for r in rows] == [("aws-a + gcp-b", "spothedge"),
                                                         ("aws-a + gcp-b", "hazard_hedge")]
    lone = _spotctl("simulate", "--trace", str(tmp_path / "aws-a"), "--one-market", "--policy", "ondemand")
    assert lone.returncode == 2 and "at least two trace groups" in lone.stderr
    paper = _spotctl("simulate", "--trace", str(tmp_path / "aws-a"), "--trace", str(tmp_path / "gcp-b"),
                     "--one-market", "--model", "spothedge-paper")
    assert paper.returncode == 2 and "--one-market does not apply" in paper.stderr
