"""The SpotHedge artifact's evaluation model: `spotctl simulate --model spothedge-paper`.

A tick model: 30 s ticks (each trace sample repeated), preemptions only at ticks and with
no notice, one spot price everywhere and on-demand a fixed multiple of it, on-demand always
granted, a single-node trace's 1 meaning unlimited capacity, fresh 24 h windows drawn with
a fixed seed, and availability counted per tick. Each tick the policy is shown the events
of the previous one, decides once (through orchestrator.fleet.decisions, like the
controller), and its launches are clipped to the zone's capacity. docs/simulator.md
derives every rule from the artifact's code and lists where this model and the replay
engine (orchestrator.sim.replay) differ. Called by `spotctl simulate` and the benchmark.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

import numpy as np

from orchestrator.common.errors import UserError
from orchestrator.fleet import decisions
from orchestrator.fleet.lifecycle import ReplicaState
from orchestrator.sim.replay import SKYSERVE_EVAL_PARAMS, SimResult, check_policies
from orchestrator.sim.traces import TraceGroup, labelled_groups
from policies.base import EventKind, MarketEvent, PlacementPolicy, ServiceParams, load_policy
from providers.base import CapacityError, Location, Market, Offer

MODEL = "spothedge-paper"
TICK = 30.0  # the artifact's time_tick_in_seconds
UNLIMITED = 10**9  # the artifact's LARGE_VALUE: what a single-node trace's 1 stands for
# The artifact samples its copy of this trace (its "2-month" trace) every 300 s; the shared
# copy's files record 195 s. Every other trace is sampled at its file's gap_seconds.
ARTIFACT_SAMPLE_SECONDS = {"aws-02-15-2023": 300.0}
_REFUSED = decisions.launch_failed(CapacityError("the zone is out of capacity at this tick"))


@dataclasses.dataclass(frozen=True)
class PaperConfig:
    target: int = 3
    cold_start: float = 120.0  # whole ticks, rounded down as the artifact's int(120 / 30)
    od_price_ratio: float = 3.0
    windows: int = 10
    window_hours: float = 24.0
    seed: int = 0
    sample_seconds: float | None = None  # None: the artifact's, else the file's gap_seconds
    zone_order: tuple[str, ...] = ()  # the zones' order before the first shuffle (default: file order)
    params: ServiceParams = SKYSERVE_EVAL_PARAMS

    def __post_init__(self):
        if self.target < 1:
            raise UserError(f"--target must be >= 1, got {self.target}")
        if self.cold_start < 0:
            raise UserError(f"--cold-start must be >= 0, got {self.cold_start}")
        if self.od_price_ratio <= 0:
            raise UserError(f"--od-price-ratio must be > 0, got {self.od_price_ratio}")
        if self.windows < 1 or self.window_hours * 3600 < 2 * TICK:
            raise UserError(f"--windows must be >= 1 and each at least two ticks, got {self.windows}")
        if self.sample_seconds is not None and self.sample_seconds < TICK:
            raise UserError(f"--sample-seconds must be >= {TICK:g}, got {self.sample_seconds}")

    @property
    def cold_ticks(self) -> int:
        return int(self.cold_start // TICK)

    @property
    def window_ticks(self) -> int:
        return int(self.window_hours * 3600 // TICK)


@dataclasses.dataclass(frozen=True)
class PaperTrace:
    """A trace group on the artifact's 30 s grid: capacity per zone and tick, and its windows."""

    group: TraceGroup
    zones: list[str]  # zone names, in the order before the first shuffle
    capacity: dict[str, np.ndarray]  # zone -> capacity per 30 s tick (UNLIMITED where a 1-node trace had 1)
    offsets: list[int]  # each window's first tick
    window_ticks: int
    spot_price: float  # $/hour, the same in every zone and at every tick


def expand(group: TraceGroup, config: PaperConfig) -> PaperTrace:
    """The group on 30 s ticks (each sample repeated, as the artifact's loader does), and the
    windows drawn as the artifact draws them. Raises UserError for a zone order that does
    not name the group's zones."""
    sample = config.sample_seconds or ARTIFACT_SAMPLE_SECONDS.get(group.folder, group.gap)
    repeat = max(1, int(sample // TICK))
    unlimited = group.single_node
    capacity = {}
    for z in group.zones:
        values = np.asarray(z.capacity, dtype=np.int64)
        if unlimited:
            values = np.where(values > 0, UNLIMITED, 0)
        capacity[z.location.zone] = np.repeat(values, repeat)
    names = [z.location.zone for z in group.zones]
    if config.zone_order:
        if sorted(config.zone_order) != sorted(names):
            raise UserError(f"--zone-order must name each zone of {group.name} once: {', '.join(names)}")
        names = list(config.zone_order)
    length = len(next(iter(capacity.values())))
    window = min(config.window_ticks, length)
    # The artifact: np.random.seed(seed), then one randint(0, L - window) per window.
    rs = np.random.RandomState(config.seed)
    offsets = [int(rs.randint(0, length - window)) if length > window else 0 for _ in range(config.windows)]
    prices = [p for z in group.zones for p in z.spot_prices]
    return PaperTrace(group, names, capacity, offsets, window, sum(prices) / len(prices))


class _Replica:
    __slots__ = ("market", "rid", "state", "t0", "zone")

    def __init__(self, rid: str, zone: int, market: Market, t0: int):
        self.rid, self.zone, self.market, self.t0 = rid, zone, market, t0
        self.state = ReplicaState.PROVISIONING


@dataclasses.dataclass
class _Score:
    up_ticks: int = 0
    scored_ticks: int = 0
    spot_ticks: int = 0
    od_ticks: int = 0
    preemptions: int = 0
    launches: int = 0
    later_grants: int = 0
    capacity_errors: int = 0


def run_window(
    policy: PlacementPolicy, locations: Sequence[Location], capacity: Sequence[np.ndarray], trace: PaperTrace,
    config: PaperConfig,
) -> _Score:
    """One window: `capacity[i]` is the window's slice for `locations[i]`."""
    cold, target, ticks = config.cold_ticks, config.target, trace.window_ticks
    zone_of = {loc: i for i, loc in enumerate(locations)}
    p = trace.spot_price
    offers = decisions.price_book(
        [Offer(loc, trace.group.kind, trace.group.kind, trace.group.gpus_per_replica, m, price, 0.0)
         for loc in locations
         for m, price in ((Market.SPOT, p), (Market.ON_DEMAND, config.od_price_ratio * p))],
        locations,
    )
    replicas: dict[str, _Replica] = {}
    pending: list[MarketEvent] = []
    score = _Score()

    def emit(kind: EventKind | None, r: _Replica, t: int) -> None:
        if kind is not None:
            pending.append(MarketEvent(kind, locations[r.zone], r.market, t * TICK, r.rid))

    for t in range(ticks):
        # 1. What happened at t - 1, then one decision on the replicas as of the end of t - 1.
        for ev in pending:
            policy.observe(ev)
        pending.clear()
        view = decisions.policy_input(
            now=t * TICK,
            target=target,
            replicas=[
                decisions.replica_view(
                    r.rid, locations[r.zone], r.market, r.state, r.t0 * TICK, None,
                    (r.t0 + cold) * TICK if r.state is ReplicaState.READY else None,
                )
                for r in replicas.values()
            ],
            locations=locations,
            offers=offers,
            params=config.params,
        )
        decision = policy.decide(view)
        if decision:
            steps = decisions.plan(decision, lambda rid: replicas[rid].state if rid in replicas else None)
            for removal in steps.removals:
                r = replicas.pop(removal.replica_id)
                emit(decisions.removed(r.state).event, r, t)
            for launch in steps.launches:
                if launch.location not in zone_of:
                    raise UserError(f"policy {policy.name!r} launched in {launch.location}, which the trace lacks")
                score.launches += 1
                rid = f"r{score.launches:06d}"
                replicas[rid] = _Replica(rid, zone_of[launch.location], launch.market, t)
            for ev in pending:  # terminations: seen before the next decision, as in the replay
                policy.observe(ev)
            pending.clear()
        # 2. The zone's capacity at t: the newest spot replicas beyond it vanish, unbilled.
        held: dict[int, list[_Replica]] = {}
        for r in replicas.values():
            if r.market is Market.SPOT:
                held.setdefault(r.zone, []).append(r)
        for zone, spot in sorted(held.items()):
            excess = len(spot) - int(capacity[zone][t])
            if excess <= 0:
                continue
            for r in sorted(spot, key=lambda r: (r.t0, r.rid), reverse=True)[:excess]:
                del replicas[r.rid]
                if r.t0 == t:
                    score.capacity_errors += 1
                    emit(_REFUSED.event, r, t)
                else:
                    score.preemptions += 1
                    emit(decisions.instance_gone(r.state, r.market).event, r, t)
        # 3. Launch outcomes and readiness at the end of t; then the tick's score.
        ready = 0
        for r in replicas.values():
            if r.t0 == t:
                r.state = decisions.LAUNCH_GRANTED.state
                score.later_grants += t > 0
                emit(decisions.LAUNCH_GRANTED.event, r, t)
            if t - r.t0 >= cold:
                ready += 1
                if r.state is ReplicaState.STARTING:
                    outcome = decisions.became_ready(r.state)
                    r.state = outcome.state or r.state
                    emit(outcome.event, r, t)
        if t >= cold:
            score.scored_ticks += 1
            score.up_ticks += ready >= target
            for r in replicas.values():
                if r.market is Market.SPOT:
                    score.spot_ticks += 1
                else:
                    score.od_ticks += 1
    return score


def simulate_paper(
    group: TraceGroup, policy_factory: Callable[[], PlacementPolicy], config: PaperConfig | None = None,
    label: str | None = None, name: str | None = None,
) -> SimResult:
    """The artifact's evaluation of one policy on one group: a fresh policy per window, the
    zones reshuffled before each (the artifact's cumulative shuffle, reseeded every window);
    cost and availability are the windows' means."""
    config = config or PaperConfig()
    trace = expand(group, config)
    loc_of = {z.location.zone: z.location for z in group.zones}
    order = list(trace.zones)
    total = _Score()
    costs, avails = [], []
    policy_name = name
    for offset in trace.offsets:
        random.Random(config.seed).shuffle(order)  # in place: the shuffles accumulate
        policy = policy_factory()
        policy_name = policy_name or policy.name
        window = [trace.capacity[z][offset : offset + trace.window_ticks] for z in order]
        s = run_window(policy, [loc_of[z] for z in order], window, trace, config)
        scored = max(1, s.scored_ticks)
        avails.append(s.up_ticks / scored)
        units = s.spot_ticks + config.od_price_ratio * s.od_ticks  # in spot replica-ticks
        costs.append(units / (config.od_price_ratio * config.target * scored))
        for f in dataclasses.fields(_Score):
            setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
    hours = TICK / 3600.0
    gpus = group.gpus_per_replica
    baseline = config.od_price_ratio * trace.spot_price * config.target * total.scored_ticks * hours
    return SimResult(
        policy=policy_name or "?",
        trace=label or group.name,
        cost_ratio=sum(costs) / len(costs),
        availability=sum(avails) / len(avails),
        spot_gpu_hours=total.spot_ticks * hours * gpus,
        on_demand_gpu_hours=total.od_ticks * hours * gpus,
        preemptions=total.preemptions,
        launches=total.launches,
        capacity_errors=total.capacity_errors,
        notices=0,
        cost=trace.spot_price * (total.spot_ticks + config.od_price_ratio * total.od_ticks) * hours,
        on_demand_baseline_cost=baseline,
        simulated_seconds=len(trace.offsets) * trace.window_ticks * TICK,
        launches_per_preemption=total.later_grants / total.preemptions if total.preemptions else 0.0,
        notice_s=0.0,
        model=MODEL,
    )


def run_paper_matrix(
    trace_dirs: Sequence, policy_names: Sequence[str], config: PaperConfig, prices: dict[str, float] | None = None
) -> list[SimResult]:
    """Every policy on every trace group under `trace_dirs`, in the paper model. Raises
    UserError for a bad policy name or trace folder."""
    check_policies(policy_names)
    return [
        simulate_paper(group, lambda name=name: load_policy(name), config, label)
        for label, group in labelled_groups(trace_dirs, prices)
        for name in policy_names
    ]
