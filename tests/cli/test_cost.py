"""`spotctl cost` through the real CLI against a real daemon (stand-in engine on the local cloud,
whose zones carry prices): the cost of a spot and an on-demand service, their savings, the
output tokens their load balancers counted, and the final cost kept when a service goes down."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.control.test_daemon import SPEC, daemon, ready  # noqa: F401 - `daemon` is a fixture
from tests.helpers import spotctl, wait_for

# Spot only, whatever the machine's speed: the default policy may cover slow-starting spot
# replicas with an on-demand one, which this test's "spot only" figures would then include.
SPOT_SPEC = SPEC.replace("  replicas: 2", "  replicas: 2\n  placement_policy: even_spread")
ON_DEMAND_SPEC = SPEC.replace("name: svc", "name: od").replace("use_spot: true", "use_spot: false") \
    .replace("replicas: 2", "replicas: 1")
REQUESTS = 5
TOKENS_PER_ANSWER = 2  # the stand-in engine's usage.completion_tokens


def cost(*args: str):
    return json.loads(spotctl("cost", *args, "--json", timeout=120).stdout)


def test_cost_of_services_through_the_cli(daemon, tmp_path):  # noqa: F811
    _, client = daemon
    for name, text in (("svc", SPOT_SPEC), ("od", ON_DEMAND_SPEC)):
        (tmp_path / f"{name}.yaml").write_text(text)
        spotctl("up", str(tmp_path / f"{name}.yaml"), "--json", timeout=120)
    wait_for(lambda: len(ready(client)) == 2 and len(ready(client, "od")) == 1, 60, "replicas READY")
    endpoint = client.get("/v1/services/svc").json()["endpoint"]
    body = {"model": "svc", "prompt": "hello", "max_tokens": 4}
    wait_for(lambda: httpx.post(endpoint + "/v1/completions", json=body, timeout=10).status_code == 200, 30,
             "the load balancer to route")
    for _ in range(REQUESTS - 1):
        assert httpx.post(endpoint + "/v1/completions", json=body, timeout=10).status_code == 200

    replicas = [r for r in client.get("/v1/services/svc").json()["replicas"] if r["state"] == "READY"]
    prices = sum(r["price_per_hour"] for r in replicas)
    first_launch = min(r["launched_at"] for r in replicas)
    report = cost("svc")
    assert report["service"] == "svc" and prices > 0
    assert report["cost_per_hour"] == pytest.approx(prices)
    assert report["by_market"]["spot"]["cost_per_hour"] == pytest.approx(prices)
    assert set(report["by_market"]) == {"spot"} and set(report["by_cloud"]) == {"local"}
    elapsed_h = (report["as_of"] - first_launch) / 3600
    assert 0 < report["cost_so_far"] <= prices * elapsed_h + 1e-9
    # The local cloud's on-demand prices are well above its spot ones.
    assert report["on_demand_equivalent"] > report["cost_so_far"]
    assert report["savings"] == pytest.approx(report["on_demand_equivalent"] - report["cost_so_far"])
    assert 0.5 < report["savings_fraction"] < 1
    assert report["output_tokens"] == REQUESTS * TOKENS_PER_ANSWER
    assert report["cost_per_million_output_tokens"] == pytest.approx(
        report["cost_since_tokens"] / report["output_tokens"] * 1e6)
    assert 0 < report["cost_since_tokens"] <= report["cost_so_far"]

    od = cost("od")
    assert set(od["by_market"]) == {"on_demand"} and od["cost_per_hour"] > 0
    assert od["savings"] == pytest.approx(0, abs=1e-12) and od["output_tokens"] == 0
    assert od["cost_per_million_output_tokens"] is None  # no tokens: null, not a division by zero

    assert [r["service"] for r in cost()] == ["od", "svc"]
    table = spotctl("cost", timeout=120, env={"COLUMNS": "250"}).stdout
    assert "svc" in table and "od" in table and "spot" in table and "on_demand" in table

    proc = spotctl("cost", "nope", check=False, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "nope" in proc.stderr

    # `down` deletes the replica rows: the final cost stays in the service_deleted event.
    spotctl("down", "svc", "-y", "--timeout", "60", timeout=120)
    deleted = [e for e in client.get("/v1/events", params={"service": "svc"}).json()
               if e["kind"] == "service_deleted"]
    assert deleted and "cost $" in deleted[-1]["message"]


def test_help_lists_cost():
    out = spotctl("--help", timeout=120, env={"COLUMNS": "200"}).stdout
    assert any(line.strip("│ ").startswith("cost ") for line in out.splitlines()), out
