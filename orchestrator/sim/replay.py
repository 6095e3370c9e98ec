"""Trace replay: drive placement policies through the daemon's interface on real spot traces.

The policy objects are the very ones the controller uses (`observe(MarketEvent)` then
`decide(PolicyInput) -> Decision`), and so is the decision code around them
(orchestrator.fleet.decisions: the policy's view of each replica, the price book, which market
event each fact is, which removals apply and in what order). Only the provider and the
clock are simulated:

- capacity: a trace value is how many spot instances of that type the zone lets one hold
  at that tick (0/1 single-node, up to 4 or 16 multi-node). When it falls below what is
  held, the warned replicas go, then (unwarned) the newest ones: deterministic.
- notices: a capacity drop at tick time T is announced `notice` seconds earlier (the sim
  looks ahead in the trace): the replicas that will be lost turn DRAINING with deadline T.
  A replica that comes up inside that window is warned as it comes up (shorter notice).
- launches: a spot launch takes `attempt` seconds to be granted or refused (refused when
  the zone already holds its capacity: a capacity_error event); a granted one is READY
  `cold_start` seconds after it was asked for. On-demand is always granted.
- cost: each granted replica is billed from the moment it was asked for until it ends, at
  the zone's spot price of each tick (trace prices where present, else the price table) or
  at its on-demand price = od_price_ratio x the zone's mean spot price over the replay.
  cost_ratio = cost / (target x the CHEAPEST zone's on-demand price x duration): what
  `target` on-demand replicas in the cheapest on-demand zone would cost (the ondemand
  baseline, which therefore scores exactly 1.0).
- availability: the fraction of time (exact, not sampled at ticks) from `cold_start` to
  the end during which at least `target` replicas serve (READY, or warned but still up
  until their deadline: SpotHedge cannot see notices, and the instance does serve).
- GPU-hours: replica-hours x the GPUs the instance kind names (v100_8: 8); CPU kinds
  (intel_64, c3-88) count instance-hours.
- the service spec the policies see (`PolicyInput.params`) is SkyServe's evaluated
  SpotHedge setting: num_overprovision=1, dynamic_ondemand_fallback=true.

The sim calls `decide` once at every trace tick and at every moment an event happens
(a launch granted or refused, a replica ready, a notice), never in between: nothing the
policy can see changes in between.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from orchestrator.fleet import decisions
from orchestrator.common.errors import UserError
from orchestrator.fleet.lifecycle import ReplicaState
from policies.base import (
    EventKind,
    MarketEvent,
    PlacementPolicy,
    ReplicaView,
    ServiceParams,
)
from providers.base import CapacityError, Location, Market, Offer, Offers

# Nominal spot $/hour per instance kind (file-name suffix) for traces without prices.
# cost_ratio depends only on ratios, so these matter only where zones differ; p3.2xlarge's
# 0.918 is the constant price the aws-04-22-2023 trace itself records.
DEFAULT_SPOT_PRICES = {
    "v100_1": 0.918,
    "v100_8": 7.344,
    "k80_1": 0.27,
    "k80_8": 2.16,
    "intel_64": 1.30,
    "c3-88": 1.40,
}
FALLBACK_SPOT_PRICE = 1.0
SKYSERVE_EVAL_PARAMS = ServiceParams(num_overprovision=1, dynamic_ondemand_fallback=True)
GPU_KINDS = ("v100", "k80", "a100", "h100", "t4", "l4", "a10g")
# A spot launch into a zone already holding its trace capacity: what the cloud would raise.
_REFUSED = decisions.launch_failed(CapacityError("the zone holds its trace capacity"))


# ---------------------------------------------------------------- traces


@dataclasses.dataclass(frozen=True)
class ZoneTrace:
    location: Location
    capacity: list[int]
    spot_prices: list[float]  # $/hour per tick, same length as capacity


@dataclasses.dataclass(frozen=True)
class TraceGroup:
    """One folder (or one instance kind of a mixed folder): the zones a policy chooses from."""

    name: str
    gap: float
    kind: str
    zones: list[ZoneTrace]

    @property
    def ticks(self) -> int:
        return len(self.zones[0].capacity)

    @property
    def duration(self) -> float:
        return self.ticks * self.gap

    @property
    def gpus_per_replica(self) -> int:
        """GPUs per instance from the kind (v100_8 -> 8); CPU kinds count instances."""
        m = re.fullmatch(r"([a-z0-9]+)_(\d+)", self.kind)
        return int(m.group(2)) if m and m.group(1) in GPU_KINDS else 1


def _split_stem(path: Path) -> tuple[str, str]:
    zone, _, kind = path.stem.partition("_")  # zone names hold no underscore
    if not zone or not kind:
        raise UserError(f"{path}: file name must be ZONE_KIND.json (e.g. us-east-1a_v100_1.json)")
    return zone, kind


def _location(cloud: str, zone: str) -> Location:
    # AWS zones end in a letter after the region (us-east-1a); GCP's after a dash (us-east1-b).
    region = zone.rsplit("-", 1)[0] if re.search(r"-[a-z]$", zone) else zone[:-1]
    return Location(cloud, region, zone)


def _read_json(path: Path) -> tuple[float, list[int], list[float] | None]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read: {err}") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: malformed JSON: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise UserError(f'{path}: expected an object with a "data" list')
    gap = (doc.get("metadata") or {}).get("gap_seconds")
    if not isinstance(gap, (int, float)) or gap <= 0:
        raise UserError(f"{path}: metadata.gap_seconds must be a positive number")
    data = doc["data"]
    if not data or not all(isinstance(v, int) and v >= 0 for v in data):
        raise UserError(f"{path}: data must be a non-empty list of counts (integers >= 0)")
    prices = doc.get("prices")
    if prices is not None:
        if not isinstance(prices, list) or not all(p is None or isinstance(p, (int, float)) for p in prices):
            raise UserError(f"{path}: prices must be a list of numbers")
        prices = _fill_prices(prices)
    return float(gap), data, prices


def _fill_prices(prices: list) -> list[float] | None:
    """Carry the last known price over gaps (None); None if the file knows no price at all."""
    known = [p for p in prices if p is not None]
    if not known:
        return None
    out, last = [], known[0]
    for p in prices:
        last = p if p is not None else last
        out.append(float(last))
    return out


def load_price_table(path: str | Path | None) -> dict[str, float]:
    """A JSON object: zone, ZONE_KIND file stem or kind -> spot $/hour (most specific wins)."""
    if path is None:
        return {}
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as err:
        raise UserError(f"price file {path}: cannot read: {err}") from None
    except json.JSONDecodeError as err:
        raise UserError(f"price file {path}: malformed JSON: {err}") from None
    if not isinstance(doc, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in doc.values()):
        raise UserError(f"price file {path}: expected an object of name -> positive $/hour")
    return {str(k): float(v) for k, v in doc.items()}


def _cloud_of(folder: Path) -> str:
    head = folder.name.split("-", 1)[0].lower()
    return head if head in ("aws", "gcp", "azure", "local") else "aws"


def load_groups(folder: str | Path, prices: dict[str, float] | None = None) -> list[TraceGroup]:
    """The trace groups of one folder: one per instance kind, each cut to the common prefix."""
    folder = Path(folder)
    files = sorted(folder.glob("*.json"))
    if not files:
        raise UserError(f"trace folder {folder}: no *.json trace files")
    prices = prices or {}
    by_kind: dict[str, list[tuple[str, Path]]] = {}
    for f in files:
        zone, kind = _split_stem(f)
        by_kind.setdefault(kind, []).append((zone, f))
    cloud = _cloud_of(folder)
    groups = []
    for kind, members in sorted(by_kind.items()):
        raw = [(zone, f, *_read_json(f)) for zone, f in members]
        gaps = {gap for _, _, gap, _, _ in raw}
        if len(gaps) != 1:
            raise UserError(f"trace folder {folder}: files of kind {kind} disagree on gap_seconds {sorted(gaps)}")
        length = min(len(data) for _, _, _, data, _ in raw)
        zones = []
        for zone, f, _gap, data, file_prices in raw:
            if file_prices is not None and len(file_prices) >= length:
                spot = file_prices[:length]
            else:
                base = prices.get(f.stem) or prices.get(zone) or prices.get(kind)
                spot = [base or DEFAULT_SPOT_PRICES.get(kind, FALLBACK_SPOT_PRICE)] * length
            zones.append(ZoneTrace(_location(cloud, zone), list(data[:length]), spot))
        name = folder.name if len(by_kind) == 1 else f"{folder.name}[{kind}]"
        groups.append(TraceGroup(name, gaps.pop(), kind, zones))
    return groups


def expand_trace_dirs(paths: Iterable[str | Path]) -> list[tuple[Path, Path | None]]:
    """(trace folder, the folder it was found under) for each path: a trace folder itself
    (root None), or a folder whose sub-folders at any depth hold trace folders."""
    out: list[tuple[Path, Path | None]] = []
    for p in paths:
        p = Path(p)
        if not p.is_dir():
            raise UserError(f"trace folder {p}: no such directory")
        if any(p.glob("*.json")):
            out.append((p, None))
            continue
        found = sorted({f.parent for f in p.rglob("*.json")})
        if not found:
            raise UserError(f"trace folder {p}: no *.json trace files in it or below it")
        out.extend((f, p) for f in found)
    return out


def group_label(group: TraceGroup, folder: Path, root: Path | None) -> str:
    """A readable name: the folder relative to the folder it was found under, if any."""
    if root is None:
        return group.name
    parent = folder.parent.relative_to(root)
    return group.name if str(parent) == "." else f"{parent.as_posix()}/{group.name}"


# ---------------------------------------------------------------- the simulated world


@dataclasses.dataclass(frozen=True)
class SimConfig:
    target: int = 3
    cold_start: float = 120.0
    notice: float = 120.0
    od_price_ratio: float = 3.0
    attempt: float = 30.0  # how long a spot launch takes to be granted or refused
    # What the service spec says (SkyServe's replica_policy); SkyServe's SpotHedge evaluation.
    params: ServiceParams = SKYSERVE_EVAL_PARAMS
    series_points: int = 0  # >0: keep about this many (t, ready, cost) samples for plots

    def __post_init__(self):
        if self.target < 1:
            raise UserError(f"--target must be >= 1, got {self.target}")
        for name in ("cold_start", "notice", "attempt"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.od_price_ratio <= 0:
            raise UserError(f"--od-price-ratio must be > 0, got {self.od_price_ratio}")


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
                out.append(Offer(z.location, g.kind, g.kind, g.gpus_per_replica, market, price, tick * g.gap))
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
        if r.market is Market.SPOT:
            self.held[r.zone] += 1
        self._apply(r, decisions.LAUNCH_GRANTED, t)
        self._push(max(t, r.asked_at + self.cfg.cold_start), _READY, r.rid)
        if r.market is Market.SPOT and self.cfg.notice > 0:
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
        hi = bisect.bisect_right(drops, (t + self.cfg.notice) / gap)
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
        notice_checks = sorted(
            (j * gap - cfg.notice, z)
            for z, ds in enumerate(self.drops)
            for j in ds
            if cfg.notice > 0 and j * gap - cfg.notice >= 0
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
    return Simulation(group, policy, config or SimConfig(), label).run()


def run_matrix(
    trace_dirs: Sequence[str | Path],
    policy_names: Sequence[str],
    config: SimConfig,
    prices: dict[str, float] | None = None,
) -> list[SimResult]:
    """Every policy on every trace group under `trace_dirs` (each run with a fresh policy)."""
    from policies.base import UnknownPolicyError, load_policy

    for name in policy_names:  # fail on a bad name before any replay
        try:
            load_policy(name)
        except UnknownPolicyError as err:
            raise UserError(str(err)) from None
        except Exception as err:  # a third-party plugin that does not load
            raise UserError(f"policy {name!r} failed to load: {type(err).__name__}: {err}") from None
    results = []
    for folder, root in expand_trace_dirs(trace_dirs):
        for group in load_groups(folder, prices):
            label = group_label(group, folder, root)
            for name in policy_names:
                results.append(simulate(group, load_policy(name), config, label))
    return results
