"""SpotHedge as SkyServe ships it: placement, the reset rule, overprovision, the on-demand cap."""

from __future__ import annotations

from orchestrator.sim.replay import SimConfig, simulate
from orchestrator.sim.traces import load_groups
from policies.base import EventKind, MarketEvent, Phase, PolicyInput, ReplicaView, ServiceParams
from policies.spothedge import LocationStatus, SpotHedgePolicy
from providers.base import Location, Market, Offer, Offers
from tests.sim.test_replay import write_trace

A = Location("aws", "us-east-1", "us-east-1a")
B = Location("aws", "us-east-1", "us-east-1b")
C = Location("aws", "us-west-2", "us-west-2a")
PRICES = {A: 1.0, B: 0.8, C: 0.9}
EVAL = ServiceParams(num_overprovision=1, dynamic_ondemand_fallback=True)


def offers(prices=PRICES) -> Offers:
    out = Offers()
    for loc, p in prices.items():
        out.append(Offer(loc, "p3.2xlarge", "V100", 1, Market.SPOT, p, 0.0))
        out.append(Offer(loc, "p3.2xlarge", "V100", 1, Market.ON_DEMAND, 3 * p, 0.0))
    return out


def view(replicas=(), target=3, params=EVAL, prices=PRICES, now=100.0) -> PolicyInput:
    return PolicyInput(now, target, list(replicas), sorted(prices), offers(prices), params)


def replica(rid, loc, phase=Phase.READY, market=Market.SPOT, launched=0.0, ready_at=50.0):
    return ReplicaView(rid, loc, market, phase, launched, None, ready_at if phase is not Phase.LAUNCHING else None)


def event(kind, loc, at=10.0, market=Market.SPOT, rid="x"):
    return MarketEvent(kind, loc, market, at, rid)


def test_first_round_fills_cheapest_unused_active_locations_then_falls_back_to_on_demand():
    d = SpotHedgePolicy().decide(view())
    spot = [x.location for x in d.launches if x.market is Market.SPOT]
    # goal = 3 + 1 overprovision; unused first by price (B 0.8, C 0.9, A 1.0), then cheapest again.
    assert spot == [B, C, A, B]
    od = [x.location for x in d.launches if x.market is Market.ON_DEMAND]
    # No READY spot yet: on-demand goal = min(target, 4 - 0) = 3, in the cheapest on-demand location.
    assert od == [B, B, B]
    assert not d.removals


def test_on_demand_fallback_counts_ready_spot_against_the_overprovisioned_goal():
    ready3 = [replica("s1", B), replica("s2", C), replica("s3", A)]
    starting = replica("s4", B, Phase.LAUNCHING)
    d = SpotHedgePolicy().decide(view([*ready3, starting]))
    # 3 READY spot + 1 launching: spot goal met; on-demand = 4 - 3 = 1.
    assert [(x.market, x.location) for x in d.launches] == [(Market.ON_DEMAND, B)]
    # With the fourth READY too, an existing on-demand replica goes.
    od = replica("o1", B, market=Market.ON_DEMAND)
    d = SpotHedgePolicy().decide(view([*ready3, replica("s4", B), od]))
    assert not d.launches and [r.replica_id for r in d.removals] == ["o1"]


def test_without_dynamic_fallback_no_on_demand_and_overprovision_zero():
    params = ServiceParams(num_overprovision=0, dynamic_ondemand_fallback=False)
    d = SpotHedgePolicy().decide(view(params=params))
    assert [x.market for x in d.launches] == [Market.SPOT] * 3
    # Constructor knobs override the service's.
    d = SpotHedgePolicy(num_overprovision=2).decide(view(params=params))
    assert len(d.launches) == 5


def test_base_on_demand_replicas_are_kept_and_reduce_the_spot_goal():
    params = ServiceParams(num_overprovision=1, base_ondemand_fallback_replicas=1, dynamic_ondemand_fallback=False)
    d = SpotHedgePolicy().decide(view(params=params))
    assert sum(x.market is Market.SPOT for x in d.launches) == 3  # 3 + 1 - 1
    assert sum(x.market is Market.ON_DEMAND for x in d.launches) == 1


def test_on_demand_is_capped_at_target_not_target_plus_overprovision():
    params = ServiceParams(num_overprovision=2, dynamic_ondemand_fallback=True)
    d = SpotHedgePolicy().decide(view(params=params))
    assert sum(x.market is Market.ON_DEMAND for x in d.launches) == 3  # min(3, 5 - 0)


def test_preemption_and_failed_launch_mark_preempted_and_fewer_than_two_active_resets():
    p = SpotHedgePolicy()
    p.decide(view())  # the placer learns its locations (SkyServe: from the task)
    p.observe(event(EventKind.CAPACITY_ERROR, B))
    assert p.status[B] is LocationStatus.PREEMPTED and p.active_locations() == [A, C]
    # Now only C would be left active: everything resets.
    p.observe(event(EventKind.PREEMPTED, A))
    assert p.active_locations() == [A, B, C]
    # A successful launch marks its location active again.
    p.observe(event(EventKind.PREEMPTED, C))
    assert p.status[C] is LocationStatus.PREEMPTED
    p.observe(event(EventKind.LAUNCHED, C))
    assert p.status[C] is LocationStatus.ACTIVE


def test_preempted_location_is_skipped_and_on_demand_events_are_ignored():
    p = SpotHedgePolicy()
    p.decide(view([replica(f"s{i}", A) for i in range(4)]))
    p.observe(event(EventKind.PREEMPTED, B, market=Market.ON_DEMAND))
    assert p.status.get(B, LocationStatus.ACTIVE) is LocationStatus.ACTIVE
    p.observe(event(EventKind.PREEMPTED, B))
    d = p.decide(view([replica("s1", C), replica("s2", A), replica("s3", C)]))
    # Spot goal 4, one missing; B (cheapest) is PREEMPTED; A and C both used: cheapest active is C.
    assert [x.location for x in d.launches if x.market is Market.SPOT] == [C]


def test_notices_are_ignored_and_a_warned_ready_replica_still_counts_ready():
    p = SpotHedgePolicy()
    reps = [replica("s1", B), replica("s2", C), replica("s3", A), replica("s4", B)]
    warned = ReplicaView("s4", B, Market.SPOT, Phase.DRAINING, 0.0, 200.0, 50.0)
    p.observe(event(EventKind.NOTICE, B, rid="s4"))
    d = p.decide(view([*reps[:3], warned]))
    assert not d  # nothing to do: SkyServe cannot see the notice
    assert p.status[B] is LocationStatus.ACTIVE


def test_catalog_prices_are_static_once_seen():
    p = SpotHedgePolicy()
    p.decide(view())
    cheaper_a = {A: 0.1, B: 0.8, C: 0.9}
    d = p.decide(view([replica("s1", B), replica("s2", C), replica("s3", A)], prices=cheaper_a))
    assert [x.location for x in d.launches if x.market is Market.SPOT] == [B]  # not A: cached 1.0


def test_surplus_spot_removed_earliest_phase_then_newest_first():
    reps = [
        replica("s1", B, launched=0.0),
        replica("s2", C, launched=10.0),
        replica("s3", A, launched=20.0),
        replica("s4", B, launched=30.0),
        replica("s5", C, Phase.LAUNCHING, launched=5.0),
        replica("s6", A, launched=40.0),
    ]
    d = SpotHedgePolicy().decide(view(reps))
    assert [r.replica_id for r in d.removals] == ["s5", "s6"]


def two_zones(tmp_path, a: list[int], b: list[int]):
    """A trace group of us-east-1a and us-east-1b at 600 s ticks."""
    folder = tmp_path / "aws-two"
    write_trace(folder, "us-east-1a_v100_1", a)
    write_trace(folder, "us-east-1b_v100_1", b)
    (group,) = load_groups(folder)
    return group


def test_spothedge_on_a_hand_made_trace(tmp_path):
    """Two zones, target 1, overprovision 1: a spot replica in each zone. When a runs out,
    b's replica alone is READY, one short of the spot goal of 2: one on-demand fallback runs
    until a grants again and its replica is READY."""
    group = two_zones(tmp_path, [1, 1, 0, 0, 1, 1], [1] * 6)
    r = simulate(group, SpotHedgePolicy(), SimConfig(target=1))
    assert r.preemptions == 1 and r.notices == 1
    # Spot: a over [0, 1200] + b over [0, 3600] + a again from its last ask (2370) to 3600.
    assert r.spot_gpu_hours * 3600 == 1200 + 3600 + 1230
    # On-demand: at start (no READY spot until 120) and from a's loss until a is READY again;
    # the start one is asked at 0 and removed at 120; the later one from 1200 to 2490.
    assert r.on_demand_gpu_hours * 3600 == 120 + (2490 - 1200)
    assert r.availability == 1.0


def test_events_replayed_before_the_first_decide_apply_in_order():
    """A restarted controller replays events before it first decides: same state as live."""
    live, replayed = SpotHedgePolicy(), SpotHedgePolicy()
    live.decide(view())
    events = [event(EventKind.PREEMPTED, A), event(EventKind.PREEMPTED, B), event(EventKind.PREEMPTED, C)]
    for e in events:
        live.observe(e)
        replayed.observe(e)
    replayed.decide(view())
    # A, then B (only C left: reset), then C.
    assert live.status == replayed.status == {A: LocationStatus.ACTIVE, B: LocationStatus.ACTIVE,
                                              C: LocationStatus.PREEMPTED}


def test_use_spot_off_holds_target_on_demand_and_drops_spot():
    d = SpotHedgePolicy().decide(view([replica("s1", A)], params=ServiceParams(use_spot=False)))
    assert [x.market for x in d.launches] == [Market.ON_DEMAND] * 3
    assert [r.replica_id for r in d.removals] == ["s1"]
