"""A policy from a package outside this repo, registered only through the entry-point group
`spot_orchestrator.policies`, is listed by `spotctl policies` and runs in `spotctl simulate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPOTCTL = REPO / ".venv" / "bin" / "spotctl"

PLUGIN = '''
from policies.base import Decision, Launch, PlacementPolicy
from providers.base import Market


class OneSpare(PlacementPolicy):
    """target + 1 on-demand replicas in the first location: costs exactly (target+1)/target."""

    name = "one_spare"
    description = "Test plugin: target + 1 on-demand replicas"

    def decide(self, view):
        held = view.by_market(Market.ON_DEMAND)
        want = view.target + 1 - len(held)
        return Decision(launches=[Launch(view.locations[0], Market.ON_DEMAND, "plugin")] * max(0, want))


def broken():
    raise RuntimeError("this plugin is broken on purpose")
'''


def install_plugin(site: Path) -> None:
    """What `pip install` leaves behind: the module and a dist-info with entry_points.txt."""
    (site / "spot_plugin_demo.py").write_text(PLUGIN)
    dist = site / "spot_plugin_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: spot-plugin-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""\
        [spot_orchestrator.policies]
        one_spare = spot_plugin_demo:OneSpare
        broken_demo = spot_plugin_demo:broken
        """))


def run(args: list[str], site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([str(SPOTCTL), *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(not SPOTCTL.exists(), reason=f"{SPOTCTL} missing: install the project into .venv")
def test_plugin_is_listed_and_simulated(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site)

    out = run(["policies", "--json"], site)
    assert out.returncode == 0, out.stderr
    listed = {row["name"]: row for row in json.loads(out.stdout)}
    assert listed["one_spare"]["description"] == "Test plugin: target + 1 on-demand replicas"
    assert "failed to load" in listed["broken_demo"]["description"]  # shown, not fatal
    assert {"spothedge", "hazard_hedge", "ondemand"} <= set(listed) and listed["hazard_hedge"]["default"]

    traces = tmp_path / "aws-plugin"
    traces.mkdir()
    (traces / "us-east-1a_v100_1.json").write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [1] * 30}))
    out = run(["simulate", "--trace", str(traces), "--policy", "one_spare,ondemand", "--target", "2", "--json"], site)
    assert out.returncode == 0, out.stderr
    rows = {r["policy"]: r for r in json.loads(out.stdout)}
    assert rows["one_spare"]["cost_ratio"] == pytest.approx(1.5)
    assert rows["one_spare"]["availability"] == 1.0 and rows["one_spare"]["launches"] == 3
    assert rows["ondemand"]["cost_ratio"] == pytest.approx(1.0)

    # Without the plugin on the path the name is unknown: a one-line error.
    gone = subprocess.run([str(SPOTCTL), "simulate", "--trace", str(traces), "--policy", "one_spare"],
                          capture_output=True, text=True, timeout=300)
    assert gone.returncode == 2 and "unknown policy 'one_spare'" in gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1


def test_plugin_loads_in_process(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site)
    monkeypatch.syspath_prepend(str(site))
    from policies.base import available_policies, load_policy

    assert load_policy("one_spare").name == "one_spare"
    assert available_policies()["one_spare"].startswith("Test plugin")
    sys.modules.pop("spot_plugin_demo", None)
