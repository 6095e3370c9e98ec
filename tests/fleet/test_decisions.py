"""The daemon's controller and the trace simulator run the same decision code.

The same facts (launches granted or refused by one trace's capacities, a replica ready, a
notice, a preemption) are fed to a real Controller (real SQLite store, an in-memory
provider that reads the trace) and to a Simulation of that trace. Each drives a fresh
SpotHedge; everything the policy was shown (market events, PolicyInputs) and everything it
decided must be the same on both sides, up to replica ids.
"""

from __future__ import annotations

import itertools

import pytest

from orchestrator.fleet import decisions
from orchestrator.control.controller import Controller
from orchestrator.fleet.lifecycle import ReplicaState
from orchestrator.control.launch import ReplicaLauncher
from orchestrator.sim.replay import SimConfig, Simulation, TraceGroup, ZoneTrace
from orchestrator.spec import load_spec
from orchestrator.control.clouds import Observed
from orchestrator.control.store import Store
from policies.base import (
    Decision,
    EventKind,
    Launch,
    MarketEvent,
    PlacementPolicy,
    PolicyInput,
    Removal,
    load_policy,
)
from providers.base import (
    TAG_SERVICE,
    CapacityError,
    Instance,
    InstanceStatus,
    LaunchRequest,
    Location,
    Market,
    Notice,
    NoticeKind,
    Offer,
    Provider,
    QuotaError,
)

A = Location("aws", "us-east-1", "us-east-1a")
B = Location("aws", "us-east-1", "us-east-1b")
GAP = 60.0
# Zone A holds one spot replica until tick 4 (t=240), then none; zone B always one.
CAPACITY = {A: [1, 1, 1, 1, 0, 0, 0, 0, 0, 0], B: [1] * 10}
SPEC = """
name: svc
service:
  readiness_probe: {path: /health, initial_delay_seconds: 600}
  replica_policy: {min_replicas: 2, num_overprovision: 1, dynamic_ondemand_fallback: true}
resources:
  use_spot: true
  any_of:
    - {cloud: aws, region: us-east-1, zone: us-east-1a}
    - {cloud: aws, region: us-east-1, zone: us-east-1b}
engine: {model: tiny}
kv: {enabled: false}
"""


class Recorder(PlacementPolicy):
    """Wraps a policy; logs what it was shown and what it decided, in call order."""

    def __init__(self, inner: PlacementPolicy):
        self.inner, self.name = inner, inner.name
        self.log: list[tuple[str, object]] = []

    def observe(self, event: MarketEvent) -> None:
        self.log.append(("event", event))
        self.inner.observe(event)

    def decide(self, view: PolicyInput) -> Decision:
        decision = self.inner.decide(view)
        self.log.append(("view", view))
        self.log.append(("decision", decision))
        return decision

    def normalized(self) -> list[tuple]:
        """The log with replica ids renamed in order of first appearance (r0, r1, ...)."""
        names: dict[str, str] = {}

        def rid(x: str | None) -> str | None:
            return None if x is None else names.setdefault(x, f"r{len(names)}")

        out: list[tuple] = []
        for what, item in self.log:
            if what == "event":
                out.append(("event", item.kind, item.location, item.market, item.at, rid(item.replica_id)))
            elif what == "view":
                reps = tuple(
                    (rid(r.replica_id), r.location, r.market, r.phase, r.launched_at, r.notice_deadline, r.ready_at)
                    for r in item.replicas
                )
                offers = tuple(sorted((str(o.location), o.market.value, o.price_per_hour) for o in item.offers))
                out.append(("view", item.now, item.target, reps, tuple(item.locations), offers, item.params))
            else:
                out.append((
                    "decision",
                    tuple((la.location, la.market) for la in item.launches),
                    tuple(rid(rm.replica_id) for rm in item.removals),
                ))
        return out


def trace_group() -> TraceGroup:
    return TraceGroup("agree", GAP, "v100_1", [ZoneTrace(z, cap, [0.9] * len(cap)) for z, cap in CAPACITY.items()])


class TraceProvider(Provider):
    """An in-memory cloud whose spot capacity per zone is the trace's at the clock's tick."""

    name = "aws"  # the trace's zones are AWS ones

    def __init__(self, clock):
        self.clock = clock
        self.instances: dict[str, Instance] = {}
        self._ids = itertools.count()

    def _held(self, loc: Location) -> int:
        return sum(
            1 for i in self.instances.values()
            if i.location == loc and i.market is Market.SPOT and i.status is not InstanceStatus.TERMINATED
        )

    def offers(self, accelerator=None, count=None) -> list[Offer]:
        return []

    def launch(self, request: LaunchRequest) -> Instance:
        tick = int(self.clock() // GAP)
        if request.market is Market.SPOT and self._held(request.location) >= CAPACITY[request.location][tick]:
            raise CapacityError(f"no spot capacity in {request.location}", request.location, request.market)
        inst = Instance(
            f"i-{next(self._ids)}", request.location, request.market, "v100_1", InstanceStatus.RUNNING,
            tags=request.all_tags(), endpoint="http://127.0.0.1:9", launched_at=self.clock(),
        )
        self.instances[inst.instance_id] = inst
        return inst

    def terminate(self, instance_id: str) -> None:
        self.instances[instance_id].status = InstanceStatus.TERMINATED

    def get(self, instance_id: str) -> Instance | None:
        return self.instances.get(instance_id)

    def list(self, tags=None, regions=None) -> list[Instance]:
        return [i for i in self.instances.values() if all(i.tags.get(k) == v for k, v in (tags or {}).items())]


class Launcher(ReplicaLauncher):
    def request(self, spec, row, offer, runtime) -> LaunchRequest:
        return LaunchRequest(service=spec.name, replica_id=row.replica_id, location=offer.location, market=offer.market,
                             instance_type="v100_1")


class ControllerSide:
    """Facts applied the daemon's way: through the Controller's own code paths."""

    def __init__(self, tmp_path, offers: list[Offer]):
        self.now = 0.0
        self.store = Store(f"sqlite:///{tmp_path / 'state.db'}")
        spec = load_spec(SPEC)
        self.store.create_or_update_service(spec.name, spec.to_json())
        self.provider = TraceProvider(lambda: self.now)
        self.recorder = Recorder(load_policy("spothedge"))
        # A quote outside the service's locations: both sides' price book must drop it.
        stray = Offer(Location("aws", "us-west-2", "us-west-2a"), "v100_1", "v100_1", 1, Market.SPOT, 0.1, 0.0)
        self.ctl = Controller(
            spec.name, self.store, self.provider, Launcher(), policy=self.recorder,
            offers=lambda: [*offers, stray], clock=lambda: self.now, inline_cloud_calls=True,
        )

    def replica(self, n: int):
        return sorted(self.store.list_replicas("svc", include_terminal=True), key=lambda r: r.index)[n]

    def decide(self, t: float) -> None:
        self.now = t
        self.ctl.carry_out(self.ctl._apply_policy(self.ctl.spec()))

    def ready(self, n: int, t: float) -> None:
        self.now = t
        self.ctl._apply_probe(self.replica(n), True, self.ctl.spec().service.readiness_probe)

    def notice(self, t: float, deadline: float) -> None:
        """What the cloud announces for zone A's spot replica (the trace's drop at `deadline`)."""
        self.now = t
        (doomed,) = [r for r in self.store.list_replicas("svc") if r.location == A and r.market_enum is Market.SPOT]
        self.ctl.handle_notice(Notice(doomed.instance_id, NoticeKind.PREEMPT, deadline, "test"))

    def preempt(self, t: float) -> None:
        """The cloud reclaims what the trace's capacity no longer holds."""
        self.now = t
        for inst in self.provider.instances.values():
            tick = int(t // GAP)
            if inst.market is Market.SPOT and CAPACITY[inst.location][tick] == 0:
                inst.status = InstanceStatus.TERMINATED
        self.ctl._observe_deaths(Observed(tuple(self.provider.list({TAG_SERVICE: "svc"}))))


class SimSide:
    """The same facts applied the simulator's way: through the Simulation's own code paths.
    A launch is granted or refused at once, as the controller's synchronous launch is."""

    def __init__(self, params):
        self.recorder = Recorder(load_policy("spothedge"))
        self.sim = Simulation(trace_group(), self.recorder, SimConfig(target=2, notice=120.0, params=params))

    def replica(self, n: int):
        return self.sim.replicas[f"r{n + 1:06d}"]

    def decide(self, t: float) -> None:
        tick = int(t // GAP)
        self.sim._step(t, tick)
        for r in [r for r in self.sim.replicas.values() if r.state is ReplicaState.PROVISIONING]:
            self.sim._grant(r, t, tick)

    def ready(self, n: int, t: float) -> None:
        self.sim._ready(self.replica(n), t)

    def notice(self, t: float, deadline: float) -> None:
        self.sim._warn_zone(self.sim.zone_of[A], t)  # the trace's drop at `deadline` is what warns

    def preempt(self, t: float) -> None:
        self.sim._preempt_zone(self.sim.zone_of[A], int(t // GAP), t)


def drive(side) -> None:
    """One scenario: spot launches (the third refused), both up, a notice for zone A's
    replica, its death at the deadline, and a decision after each fact."""
    side.decide(0.0)
    side.ready(0, 30.0)
    side.ready(1, 30.0)
    side.decide(30.0)
    side.notice(120.0, deadline=240.0)
    side.decide(120.0)
    side.preempt(240.0)
    side.decide(240.0)
    side.decide(300.0)


def until_last_decision(log: list[tuple]) -> list[tuple]:
    last = max(i for i, entry in enumerate(log) if entry[0] == "decision")
    return log[: last + 1]


def test_controller_and_simulator_show_the_policy_the_same_things_and_it_decides_the_same(state_home, tmp_path):
    offers = list(Simulation(trace_group(), load_policy("ondemand"), SimConfig()).offers(0))
    live = ControllerSide(tmp_path, offers)
    sim = SimSide(live.ctl.spec().policy_params())
    drive(live)
    drive(sim)
    # Up to the last decision: events after it reach the simulator's policy at its next step.
    got_live, got_sim = until_last_decision(live.recorder.normalized()), until_last_decision(sim.recorder.normalized())
    kinds = [e[1] for e in got_live if e[0] == "event"]
    # The scenario really exercises every fact (a test that can fail for the right reason).
    assert {EventKind.LAUNCHED, EventKind.CAPACITY_ERROR, EventKind.READY, EventKind.NOTICE,
            EventKind.PREEMPTED} <= set(kinds), kinds
    assert any(e[0] == "decision" and e[1] for e in got_live[1:]), "no launch after the first decision"
    for i, (a, b) in enumerate(zip(got_live, got_sim, strict=False)):
        assert a == b, f"step {i}: controller {a} != simulator {b}"
    assert len(got_live) == len(got_sim)
    # The controller counts the same facts for the daemon's /metrics (orchestrator.control.metrics).
    counters = live.ctl.counters
    for counter, kind, labels in ((counters.preemptions, "preempted", {}), (counters.notices, "notice", {}),
                                  (counters.launch_failures, "capacity_error", {"kind": "capacity"})):
        counted = sum(s.value for family in counter.collect() for s in family.samples
                      if s.name.endswith("_total") and labels.items() <= s.labels.items())
        assert counted == len(live.store.list_events(service="svc", kinds=[kind])) > 0, kind
    live.ctl.close()


# ---- the shared pieces on their own ---------------------------------------------------


@pytest.mark.parametrize(
    ("state", "market", "expected"),
    [
        (ReplicaState.READY, Market.SPOT, decisions.Outcome(ReplicaState.PREEMPTED, EventKind.PREEMPTED)),
        (ReplicaState.DRAINING, Market.ON_DEMAND, decisions.Outcome(ReplicaState.PREEMPTED, EventKind.PREEMPTED)),
        (ReplicaState.READY, Market.ON_DEMAND, decisions.Outcome(ReplicaState.FAILED)),
        (ReplicaState.PROVISIONING, Market.SPOT, decisions.NOTHING),
        (ReplicaState.SHUTTING_DOWN, Market.SPOT, decisions.NOTHING),
    ],
)
def test_a_vanished_instance_is_a_preemption_only_for_spot_or_warned_replicas(state, market, expected):
    assert decisions.instance_gone(state, market) == expected


def test_only_capacity_refusals_teach_the_policy_and_repeat_notices_change_nothing():
    assert decisions.launch_failed(CapacityError("full")).event is EventKind.CAPACITY_ERROR
    assert decisions.launch_failed(QuotaError("quota")) == decisions.Outcome(ReplicaState.FAILED_PROVISION)
    assert decisions.notice_arrived(ReplicaState.READY) == decisions.Outcome(ReplicaState.DRAINING, EventKind.NOTICE)
    assert decisions.notice_arrived(ReplicaState.DRAINING) is decisions.NOTHING
    assert decisions.notice_arrived(ReplicaState.PROVISIONING) is decisions.NOTHING


def test_plan_drops_removals_of_unknown_dead_or_repeated_replicas_and_keeps_launch_order():
    states = {"a": ReplicaState.READY, "dead": ReplicaState.PREEMPTED, "b": ReplicaState.PENDING}
    launches = [Launch(A, Market.SPOT, "x"), Launch(B, Market.ON_DEMAND, "y")]
    d = Decision(
        launches=launches,
        removals=[Removal("a", "1"), Removal("ghost", "2"), Removal("dead", "3"), Removal("a", "4"), Removal("b", "5")],
    )
    steps = decisions.plan(d, states.get)
    assert [r.replica_id for r in steps.removals] == ["a", "b"]
    assert steps.launches == launches
