"""The replay engine: drive placement policies through the daemon's interface on spot traces.

The policy objects are the ones the controller uses (`observe(MarketEvent)`, then
`decide(PolicyInput) -> Decision`), and so is the decision code around them
(orchestrator.fleet.decisions). Only the provider and the clock are simulated, event by
event in continuous time: capacity from the trace, preemption notices looked up ahead in the
trace (by default as long as the trace's cloud gives, providers.notice), 30 s launch attempts,
a cold start, per-second billing. docs/simulator.md describes the model and its numbers.
Called by `spotctl simulate`, the policy benchmark and the tests; `simulate()` is one run.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from orchestrator.common.errors import UserError
from orchestrator.fleet import decisions
from orchestrator.fleet.lifecycle import ReplicaState
from orchestrator.sim.traces import TraceGroup, ZoneTrace, labelled_groups, one_market
from policies.base import (
    EventKind,
    MarketEvent,
    PlacementPolicy,
    ReplicaView,
    ServiceParams,
    UnknownPolicyError,
    load_policy,
)
from providers.base import CapacityError, Location, Market, Offer, Offers
from providers.notice import notice_seconds

__all__ = ["SKYSERVE_EVAL_PARAMS", "SimConfig", "SimResult", "Simulation", "TraceGroup", "ZoneTrace",
           "check_policies", "run_matrix", "simulate"]

SKYSERVE_EVAL_PARAMS = ServiceParams(num_overprovision=1, dynamic_ondemand_fallback=True)
# A spot launch into a zone already holding its trace capacity: what the cloud would raise.
_REFUSED = decisions.launch_failed(CapacityError("the zone holds its trace capacity"))


# ---------------------------------------------------------------- the simulated world


@dataclasses.dataclass(frozen=True)
class SimConfig:
    target: int = 3
    cold_start: float = 120.0
    notice: float | None = None  # None: the notice the trace's cloud gives (providers.notice)
    od_price_ratio: float = 3.0
    attempt: float = 30.0  # how long a spot launch takes to be granted or refused
    # What the service spec says (SkyServe's replica_policy); SkyServe's SpotHedge evaluation.
    params: ServiceParams = SKYSERVE_EVAL_PARAMS
    series_points: int = 0  # >0: keep about this many (t, ready, cost) samples for plots

    def __post_init__(self):
        if self.target < 1:
            raise UserError(f"--target must be >= 1, got {self.target}")
        for name in ("cold_start", "notice", "attempt"):
            if (getattr(self, name) or 0) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.od_price_ratio <= 0:
            raise UserError(f"--od-price-ratio must be > 0, got {self.od_price_ratio}")

    def notice_for(self, group: TraceGroup) -> float:
        """The notice a replay of `group` gives: the configured one, else its cloud's (the
        shortest of its clouds' for a merged group)."""
        return min(self.notice_for_zone(z) for z in group.zones)

    def notice_for_zone(self, zone: ZoneTrace) -> float:
        """The notice a replica in `zone` gets: the configured one, else its cloud's."""
        return self.notice if self.notice is not None else notice_seconds(zone.location.cloud)


@dataclasses.dataclass
class SimResult:
    policy: str
    trace: str
    cost_ratio: float
    availability: float
    spot_gpu_hours: float
    on_demand_gpu_hours: float
    preemptions: int
    launches: int
    capacity_errors: int
    notices: int
    cost: float
    on_demand_baseline_cost: float
    simulated_seconds: float
    # Granted launches after the first decision per replica lost to the cloud: a replacement
    # and at most one cover each is 2 at most; 0.0 without preemptions.
    launches_per_preemption: float = 0.0
    notice_s: float = 0.0
    model: str = "replay"
    series: list[tuple[float, int, float]] = dataclasses.field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("series")
        return d


class _Replica:
    """A simulated replica: the fields of the store's ReplicaRow that decisions read."""

    __slots__ = ("asked_at", "deadline", "granted", "market", "ready_at", "rid", "state", "view", "zone")

    def __init__(self, rid: str, zone: int, market: Market, asked_at: float):
        self.rid, self.zone, self.market, self.asked_at = rid, zone, market, asked_at
        self.granted = False
        self.ready_at: float | None = None
        self.deadline: float | None = None
        # The request is with the provider (the controller's PROVISIONING) until granted.
        self.state = ReplicaState.PROVISIONING
        self.view: ReplicaView | None = None  # cached until a field it shows changes


# Order of simultaneous happenings: a replica that becomes ready at the instant another is
# preempted covers for it (what a notice as long as the cold start buys).
_GRANT, _READY, _TICK, _NOTICE = 0, 1, 2, 3


class Simulation:
    """One policy on one trace group."""

    def __init__(self, group: TraceGroup, policy: PlacementPolicy, config: SimConfig, label: str | None = None):
        self.g, self.policy, self.cfg = group, policy, config
        self.notice = config.notice_for(group)
        self.zone_notice = [config.notice_for_zone(z) for z in group.zones]  # clouds differ in a merged group
        self.label = label or group.name
        self.locations = [z.location for z in group.zones]
        self.zone_of = {loc: i for i, loc in enumerate(self.locations)}
        gap, n = group.gap, group.ticks
        self.od_price = [config.od_price_ratio * sum(z.spot_prices) / n for z in group.zones]
        # cum[z][j] = spot dollars per replica from t=0 to tick j: any span's price in O(1).
        self.cum = []
        for z in group.zones:
            acc, c = 0.0, [0.0]
            for p in z.spot_prices:
                acc += p * gap / 3600.0
                c.append(acc)
            self.cum.append(c)
        # Ticks at which a zone's capacity falls: the only moments preemptions can happen.
        self.drops = [
            [j for j in range(1, n) if z.capacity[j] < z.capacity[j - 1]] for z in group.zones
        ]
        self.drops_at: dict[int, list[int]] = {}
        for z, ds in enumerate(self.drops):
            for j in ds:
                self.drops_at.setdefault(j, []).append(z)
        self.replicas: dict[str, _Replica] = {}
        self.events: list[tuple[float, int, int, str]] = []  # heap: (time, order, seq, rid)
        self.seq = 0
        self.held = [0] * len(group.zones)  # granted spot replicas alive per zone
        self.pending_events: list[MarketEvent] = []
        self.stats = {"preemptions": 0, "launches": 0, "capacity_errors": 0, "notices": 0}
        self.later_grants = 0  # granted launches asked for after t=0 (churn per preemption)
        self.closed_cost = 0.0
        self.gpu_seconds = {Market.SPOT: 0.0, Market.ON_DEMAND: 0.0}
        self._offers: Offers | None = None  # the price book, rebuilt only when prices change
        self._offers_tick = -1

    # --- prices and billing

    def _spot_cost(self, zone: int, t0: float, t1: float) -> float:
        return self._cum_at(zone, t1) - self._cum_at(zone, t0)

    def _cum_at(self, zone: int, t: float) -> float:
        gap, c = self.g.gap, self.cum[zone]
        j = min(int(t // gap), self.g.ticks - 1)
        return c[j] + self.g.zones[zone].spot_prices[j] * (t - j * gap) / 3600.0

    def _bill(self, r: _Replica, until: float) -> float:
        if not r.granted:
            return 0.0
        if r.market is Market.SPOT:
            return self._spot_cost(r.zone, r.asked_at, until)
        return self.od_price[r.zone] * (until - r.asked_at) / 3600.0

    def offers(self, tick: int) -> Offers:
        if self._offers is not None and not self._prices_changed(self._offers_tick, tick):
            return self._offers
        out = Offers()
        g = self.g
        for i, z in enumerate(g.zones):
            for market, price in ((Market.SPOT, z.spot_prices[tick]), (Market.ON_DEMAND, self.od_price[i])):
                kind = z.kind or g.kind
                out.append(Offer(z.location, kind, kind, g.gpus_per_replica, market, price, tick * g.gap))
        self._offers, self._offers_tick = decisions.price_book(out, self.locations), tick
        return self._offers

    def _prices_changed(self, a: int, b: int) -> bool:
        return any(z.spot_prices[a] != z.spot_prices[b] for z in self.g.zones)

    # --- lifecycle

    def _push(self, t: float, order: int, rid: str) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, order, self.seq, rid))

    def _emit(self, kind: EventKind, r: _Replica, t: float) -> None:
        self.pending_events.append(MarketEvent(kind, self.locations[r.zone], r.market, t, r.rid))

    def _apply(self, r: _Replica, outcome: decisions.Outcome, t: float) -> None:
        """A fact's consequence, as the controller applies it to a store row."""
        if outcome.state is not None:
            r.state = outcome.state
        r.view = None
        if outcome.event is not None:
            self._emit(outcome.event, r, t)

    def _view(self, r: _Replica) -> ReplicaView:
        if r.view is None:
            r.view = decisions.replica_view(
                r.rid, self.locations[r.zone], r.market, r.state, r.asked_at, r.deadline, r.ready_at
            )
        return r.view

    def _end(self, r: _Replica, t: float, kind: EventKind | None) -> None:
        cost = self._bill(r, t)
        self.closed_cost += cost
        if r.granted:
            self.gpu_seconds[r.market] += (t - r.asked_at) * self.g.gpus_per_replica
            if r.market is Market.SPOT:
                self.held[r.zone] -= 1
        del self.replicas[r.rid]
        if kind is EventKind.PREEMPTED:
            self.stats["preemptions"] += 1
        if kind is not None:
            self._emit(kind, r, t)

    def _launch(self, loc: Location, market: Market, t: float) -> None:
        if loc not in self.zone_of:
            raise UserError(f"policy {self.policy.name!r} launched in {loc}, which trace {self.label} lacks")
        self.stats["launches"] += 1
        rid = f"r{self.stats['launches']:06d}"
        r = _Replica(rid, self.zone_of[loc], market, t)
        self.replicas[rid] = r
        # At least a second: a policy that relaunches on every refusal must not spin in place.
        attempt = max(1.0, min(self.cfg.attempt, self.cfg.cold_start))
        self._push(t + attempt, _GRANT, rid)

    def _grant(self, r: _Replica, t: float, tick: int) -> None:
        if r.market is Market.SPOT and self.held[r.zone] >= self.g.zones[r.zone].capacity[tick]:
            self.stats["capacity_errors"] += 1
            del self.replicas[r.rid]  # FAILED_PROVISION: terminal, never billed
            self._apply(r, _REFUSED, t)
            return
        r.granted = True
        if r.asked_at > 0:
            self.later_grants += 1
        if r.market is Market.SPOT:
            self.held[r.zone] += 1
        self._apply(r, decisions.LAUNCH_GRANTED, t)
        self._push(max(t, r.asked_at + self.cfg.cold_start), _READY, r.rid)
        if r.market is Market.SPOT and self.zone_notice[r.zone] > 0:
            self._warn_zone(r.zone, t)  # came up inside a notice window: warned at once

    def _ready(self, r: _Replica, t: float) -> None:
        r.ready_at = t
        self._apply(r, decisions.became_ready(r.state), t)

    def _spot_in(self, zone: int) -> list[_Replica]:
        return [r for r in self.replicas.values() if r.zone == zone and r.granted and r.market is Market.SPOT]

    def _warn_zone(self, zone: int, t: float) -> None:
        """Warn the replicas that the zone's capacity drops within the notice window will take."""
        gap, drops, cap = self.g.gap, self.drops[zone], self.g.zones[zone].capacity
        lo = bisect.bisect_right(drops, t / gap)
        hi = bisect.bisect_right(drops, (t + self.zone_notice[zone]) / gap)
        for j in drops[lo:hi]:
            deadline = j * gap
            if deadline <= t:
                continue
            alive = [r for r in self._spot_in(zone) if r.deadline is None or r.deadline > deadline]
            excess = len(alive) - cap[j]
            unwarned = _newest_first(r for r in alive if r.deadline is None)
            for r in unwarned[: max(0, excess)]:
                r.deadline = deadline
                self.stats["notices"] += 1
                self._apply(r, decisions.notice_arrived(r.state), t)

    def _preempt_zone(self, zone: int, tick: int, t: float) -> None:
        spot = self._spot_in(zone)
        doomed = [r for r in spot if r.deadline is not None and r.deadline <= t]
        survivors = _newest_first(r for r in spot if r not in doomed)
        excess = len(survivors) - self.g.zones[zone].capacity[tick]
        doomed += survivors[: max(0, excess)]  # no warning reached these
        for r in doomed:
            self._end(r, t, decisions.instance_gone(r.state, r.market).event)

    # --- the loop

    def run(self) -> SimResult:
        g, cfg = self.g, self.cfg
        gap, end = g.gap, g.duration
        # Look-ahead moments (a drop's time minus the notice); earlier ones than the start are
        # covered by warning each replica as it comes up.
        notice, zn = self.notice, self.zone_notice
        notice_checks = sorted(
            (j * gap - zn[z], z) for z, ds in enumerate(self.drops) for j in ds if zn[z] > 0 and j * gap - zn[z] >= 0
        )
        nc = 0
        tick = 0
        serving = 0
        last_t, up_time = 0.0, 0.0
        avail_from = min(cfg.cold_start, end)
        series_every = max(1, g.ticks // cfg.series_points) if cfg.series_points else 0
        series: list[tuple[float, int, float]] = []
        while True:
            t_tick = tick * gap if tick < g.ticks else math.inf
            t_event = self.events[0][0] if self.events else math.inf
            t_notice = notice_checks[nc][0] if nc < len(notice_checks) else math.inf
            t = min(t_tick, t_event, t_notice)
            if t >= end:
                break
            if serving >= cfg.target and t > avail_from:
                up_time += t - max(last_t, avail_from)
            last_t = t
            cur_tick = min(int(t // gap), g.ticks - 1)
            while self.events and self.events[0][0] == t and self.events[0][1] < _TICK:
                _, order, _, rid = heapq.heappop(self.events)
                r = self.replicas.get(rid)
                if r is None:
                    continue  # removed by the policy before it came up
                if order == _GRANT:
                    self._grant(r, t, cur_tick)
                else:
                    self._ready(r, t)
            if t == t_tick:
                for z in self.drops_at.get(tick, ()):
                    self._preempt_zone(z, tick, t)
                tick += 1
            while nc < len(notice_checks) and notice_checks[nc][0] == t:
                self._warn_zone(notice_checks[nc][1], t)
                nc += 1
            self._step(t, cur_tick)
            serving = sum(1 for r in self.replicas.values() if r.ready_at is not None)
            if series_every and t == t_tick and (tick - 1) % series_every == 0:
                series.append((t, serving, self._cost_so_far(t)))
        if serving >= cfg.target and end > avail_from:
            up_time += end - max(last_t, avail_from)
        for r in list(self.replicas.values()):
            self._end(r, end, EventKind.TERMINATED)
        baseline = cfg.target * min(self.od_price) * end / 3600.0
        span = end - avail_from
        return SimResult(
            policy=self.policy.name,
            trace=self.label,
            cost_ratio=self.closed_cost / baseline if baseline > 0 else 0.0,
            availability=up_time / span if span > 0 else 1.0,
            spot_gpu_hours=self.gpu_seconds[Market.SPOT] / 3600.0,
            on_demand_gpu_hours=self.gpu_seconds[Market.ON_DEMAND] / 3600.0,
            cost=self.closed_cost,
            on_demand_baseline_cost=baseline,
            simulated_seconds=end,
            launches_per_preemption=self.later_grants / self.stats["preemptions"] if self.stats["preemptions"] else 0.0,
            notice_s=notice,
            series=series,
            **self.stats,
        )

    def _cost_so_far(self, t: float) -> float:
        return self.closed_cost + sum(self._bill(r, t) for r in self.replicas.values())

    def _step(self, t: float, tick: int) -> None:
        """Show the policy what happened, ask it what to do, do it (as the controller does)."""
        events, self.pending_events = self.pending_events, []
        for ev in events:
            self.policy.observe(ev)
        view = decisions.policy_input(
            now=t,
            target=self.cfg.target,
            replicas=[self._view(r) for r in self.replicas.values()],
            locations=self.locations,
            offers=self.offers(tick),
            params=self.cfg.params,
        )
        decision = self.policy.decide(view)
        if not decision:
            return  # the common case: nothing to carry out, nothing new to show
        steps = decisions.plan(decision, self._state_of)
        for removal in steps.removals:
            r = self.replicas[removal.replica_id]
            # Removed on purpose: its instance goes at once (the sim has no shutdown delay).
            self._end(r, t, decisions.removed(r.state).event)
        for launch in steps.launches:
            self._launch(launch.location, launch.market, t)
        # Terminations are events too: the policy sees them before its next decision.
        for ev in self.pending_events:
            self.policy.observe(ev)
        self.pending_events = []


    def _state_of(self, rid: str) -> ReplicaState | None:
        r = self.replicas.get(rid)
        return r.state if r is not None else None


def _newest_first(replicas: Iterable[_Replica]) -> list[_Replica]:
    return sorted(replicas, key=lambda r: (r.asked_at, r.rid), reverse=True)


def simulate(
    group: TraceGroup, policy: PlacementPolicy, config: SimConfig | None = None, label: str | None = None
) -> SimResult:
    """One replay of `policy` on `group`. Raises UserError if the policy launches in a zone
    the trace lacks."""
    return Simulation(group, policy, config or SimConfig(), label).run()


def check_policies(policy_names: Sequence[str]) -> None:
    """Raises UserError for a name that is not a registered policy or that fails to load,
    so that a bad name fails before any replay."""
    for name in policy_names:
        try:
            load_policy(name)
        except UnknownPolicyError as err:
            raise UserError(str(err)) from None
        except Exception as err:  # a third-party plugin that does not load
            raise UserError(f"policy {name!r} failed to load: {type(err).__name__}: {err}") from None


def run_matrix(
    trace_dirs: Sequence[str | Path],
    policy_names: Sequence[str],
    config: SimConfig,
    prices: dict[str, float] | None = None,
    merged: bool = False,
) -> list[SimResult]:
    """Every policy on every trace group under `trace_dirs` (each run with a fresh policy);
    `merged`: all of them as one market. Raises UserError for a bad policy name or trace folder."""
    check_policies(policy_names)
    groups = one_market(trace_dirs, prices) if merged else labelled_groups(trace_dirs, prices)
    return [simulate(group, load_policy(name), config, label) for label, group in groups for name in policy_names]
