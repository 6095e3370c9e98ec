"""The cost arithmetic (orchestrator.control.costing), on hand-made replicas and quotes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from orchestrator.control.costing import Billed, TokenCount, billed_replicas, quote_lookup, service_cost
from providers.base import Location, Market, Offer

H = 3600.0
NOW = 100 * H
A = Location("aws", "us-east-1", "us-east-1a")
B = Location("gcp", "us-central1", "us-central1-a")
OFFERS = [
    Offer(A, "g5.xlarge", "A10G", 1, Market.SPOT, 0.40),
    Offer(A, "g5.xlarge", "A10G", 1, Market.ON_DEMAND, 1.00),
    Offer(B, "g2-standard-4", "L4", 1, Market.ON_DEMAND, 0.80),
    Offer(B, "g2-standard-4", "L4", 1, Market.SPOT, 0.25),
]


def billed(rid, loc, market, itype, price, started, ended=None) -> Billed:
    return Billed(rid, loc.cloud, loc.region, loc.zone, market, itype, price, started, ended)


def fleet() -> list[Billed]:
    return [
        billed("s-1", A, Market.SPOT, "g5.xlarge", 0.40, NOW - 2 * H),  # running 2 h
        billed("s-2", B, Market.ON_DEMAND, "g2-standard-4", 0.80, NOW - 1 * H),  # running 1 h
        billed("s-3", A, Market.SPOT, "g5.xlarge", 0.50, NOW - 10 * H, NOW - 7 * H),  # preempted after 3 h
        billed("s-4", B, Market.SPOT, None, None, None, NOW - 5 * H),  # never got a machine
    ]


def test_spot_on_demand_and_terminated_replicas_add_up():
    r = service_cost("s", fleet(), quote_lookup(OFFERS), NOW)
    assert r.cost_so_far == pytest.approx(2 * 0.40 + 1 * 0.80 + 3 * 0.50)
    assert r.cost_per_hour == pytest.approx(0.40 + 0.80)  # the terminated replica costs nothing now
    assert r.replica_hours == pytest.approx(6)
    assert r.by_market["spot"].cost_so_far == pytest.approx(0.80 + 1.50)
    assert r.by_market["spot"].cost_per_hour == pytest.approx(0.40)
    assert r.by_market["on_demand"].cost_so_far == pytest.approx(0.80)
    assert r.by_cloud["aws"].replica_hours == pytest.approx(5)
    assert r.by_cloud["gcp"].cost_per_hour == pytest.approx(0.80)
    assert r.unpriced == []


def test_savings_price_spot_hours_on_demand_in_the_same_location():
    r = service_cost("s", fleet(), quote_lookup(OFFERS), NOW)
    # aws spot hours at aws on demand ($1.00), the on-demand replica at its own price.
    assert r.on_demand_equivalent == pytest.approx(2 * 1.00 + 1 * 0.80 + 3 * 1.00)
    assert r.on_demand_equivalent_per_hour == pytest.approx(1.00 + 0.80)
    assert r.savings == pytest.approx(5.80 - 3.10)
    assert r.savings_fraction == pytest.approx(2.70 / 5.80)


def test_cost_per_million_tokens_covers_the_counters_window_only():
    tokens = TokenCount(output_tokens=2_000_000, since=NOW - 1 * H)  # the LB started an hour ago
    r = service_cost("s", fleet(), quote_lookup(OFFERS), NOW, tokens)
    assert r.cost_since_tokens == pytest.approx(0.40 + 0.80)
    assert r.cost_per_million_output_tokens == pytest.approx(1.20 / 2)
    assert r.output_tokens == 2_000_000 and r.tokens_since == NOW - H


@pytest.mark.parametrize("tokens", [None, TokenCount(0, NOW - H)])
def test_no_tokens_is_null_not_a_division_by_zero(tokens):
    r = service_cost("s", fleet(), quote_lookup(OFFERS), NOW, tokens)
    assert r.cost_per_million_output_tokens is None
    assert json.loads(json.dumps(r.as_dict()))["cost_per_million_output_tokens"] is None


def test_a_replica_without_a_recorded_price_takes_its_quote_or_is_listed_unpriced():
    quoted = billed("q-1", A, Market.SPOT, "g5.xlarge", None, NOW - H)
    unknown = billed("q-2", Location("azure", "eastus", "eastus-1"), Market.SPOT, "NC4", None, NOW - H)
    r = service_cost("q", [quoted, unknown], quote_lookup(OFFERS), NOW)
    assert r.cost_so_far == pytest.approx(0.40)
    assert r.unpriced == ["q-2"]
    assert r.on_demand_equivalent == pytest.approx(1.00)  # no savings claimed for q-2


def test_an_empty_service_costs_zero_with_no_savings_fraction():
    r = service_cost("e", [], quote_lookup(OFFERS), NOW)
    assert (r.cost_so_far, r.cost_per_hour, r.on_demand_equivalent, r.savings) == (0, 0, 0, 0)
    assert r.savings_fraction is None and r.by_market == {}


def test_quotes_fall_back_to_the_region_then_to_the_location():
    quote = quote_lookup(OFFERS)
    assert quote("aws", "us-east-1", "us-east-1b", "g5.xlarge", Market.ON_DEMAND) == 1.00  # same region
    assert quote("gcp", "us-central1", "us-central1-a", None, Market.SPOT) == 0.25  # type unknown
    assert quote("aws", "us-west-2", "us-west-2a", "g5.xlarge", Market.SPOT) is None


def test_billed_replicas_end_at_the_first_terminal_transition():
    def row(rid, state, updated_at):
        return SimpleNamespace(replica_id=rid, state=state, cloud="local", region="local", zone="local-a",
                               market="spot", instance_type="local-cpu", price_per_hour=0.3,
                               launched_at=10.0, updated_at=updated_at)

    def event(rid, to, at):
        return SimpleNamespace(replica_id=rid, at=at, data_json=json.dumps({"to": to}))

    rows = [row("r-1", "READY", 99.0), row("r-2", "FAILED_CLEANUP", 99.0), row("r-3", "PREEMPTED", 77.0)]
    events = [event("r-1", "READY", 20.0), event("r-2", "FAILED", 50.0), event("r-2", "FAILED_CLEANUP", 60.0)]
    out = {b.replica_id: b for b in billed_replicas(rows, events)}
    assert out["r-1"].ended_at is None and out["r-1"].running()
    assert out["r-2"].ended_at == 50.0
    assert out["r-3"].ended_at == 77.0  # its events are gone: the row's last update
    assert out["r-2"].hours(now=1000.0) == pytest.approx(40 / H)
