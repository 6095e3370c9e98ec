"""What a service has cost: pure arithmetic over its replicas' billed intervals and prices.

The daemon (`Daemon.cost`, behind `GET /v1/cost`) turns replica rows and their transition events
into `Billed` intervals (`billed_replicas`), prices them with a quote lookup over the service's
offers (`quote_lookup`) and calls `service_cost`; `spotctl cost` prints the result. A replica is
billed at the hourly price recorded when it was launched, from the cloud's launch time (boot and
provisioning are billed) until it reached a terminal state, or until now. docs/prices.md
("What a service has cost") says the same in prose.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping

from orchestrator.fleet.lifecycle import TERMINAL_STATES
from providers.base import Market, Offer

HOUR_S = 3600.0
# (cloud, region, zone, instance_type, market) -> $/h, or None when no quote is known.
Quote = Callable[[str, str, str, str | None, Market], float | None]
_TERMINAL = frozenset(s.value for s in TERMINAL_STATES)


@dataclasses.dataclass(frozen=True)
class Billed:
    """One replica as billing sees it: where, on which market, at what price, from when to when."""

    replica_id: str
    cloud: str
    region: str
    zone: str
    market: Market
    instance_type: str | None
    price_per_hour: float | None  # recorded at launch; None: ask the quote lookup
    started_at: float | None  # the cloud's launch time; None: no machine yet (nothing billed)
    ended_at: float | None = None  # reached a terminal state; None: still billed

    def hours(self, now: float, since: float | None = None) -> float:
        """Billed hours up to `now`, counting only those after `since` when given."""
        if self.started_at is None:
            return 0.0
        start = self.started_at if since is None else max(self.started_at, since)
        end = min(self.ended_at, now) if self.ended_at is not None else now
        return max(0.0, end - start) / HOUR_S

    def running(self) -> bool:
        return self.started_at is not None and self.ended_at is None


@dataclasses.dataclass(frozen=True)
class TokenCount:
    """Output tokens the load balancer counted, and since when (its counters start with it)."""

    output_tokens: int
    since: float


@dataclasses.dataclass
class Part:
    """Cost of a slice of the fleet (one market, or one cloud)."""

    cost_so_far: float = 0.0
    cost_per_hour: float = 0.0
    replica_hours: float = 0.0
    replicas: int = 0


@dataclasses.dataclass
class CostReport:
    """What `spotctl cost SERVICE --json` prints (`as_dict`). Money is in $, rates in $/h.

    `on_demand_equivalent` is what the same replica-hours would have cost on demand in the same
    locations; `savings_fraction` is None when that is 0. `cost_per_million_output_tokens` covers
    only the window the token counter does (`tokens_since`), and is None with no tokens yet.
    """

    service: str
    as_of: float
    cost_so_far: float = 0.0
    cost_per_hour: float = 0.0
    replica_hours: float = 0.0
    on_demand_equivalent: float = 0.0
    on_demand_equivalent_per_hour: float = 0.0
    savings: float = 0.0
    savings_fraction: float | None = None
    by_market: dict[str, Part] = dataclasses.field(default_factory=dict)
    by_cloud: dict[str, Part] = dataclasses.field(default_factory=dict)
    output_tokens: int | None = None
    tokens_since: float | None = None
    cost_since_tokens: float | None = None
    cost_per_million_output_tokens: float | None = None
    unpriced: list[str] = dataclasses.field(default_factory=list)  # billed replicas with no price known
    replicas: list[dict] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def service_cost(service: str, replicas: Iterable[Billed], quote: Quote, now: float,
                 tokens: TokenCount | None = None) -> CostReport:
    """The service's cost so far and per hour, by market and cloud, against on demand.

    A replica without a recorded price takes its market's quote (none known: it counts 0 and is
    listed in `unpriced`); its on-demand equivalent is its own price on demand, else the quote
    for its location on demand, else its own price (no savings claimed for what is unknown).
    """
    report = CostReport(service=service, as_of=now)
    if tokens is not None:
        report.output_tokens, report.tokens_since, report.cost_since_tokens = tokens.output_tokens, tokens.since, 0.0
    for r in replicas:
        where = (r.cloud, r.region, r.zone, r.instance_type)
        price = r.price_per_hour if r.price_per_hour is not None else quote(*where, r.market)
        hours = r.hours(now)
        if price is None:
            price = 0.0
            if hours > 0:
                report.unpriced.append(r.replica_id)
        on_demand = price if r.market is Market.ON_DEMAND else quote(*where, Market.ON_DEMAND)
        on_demand = price if on_demand is None else on_demand
        per_hour = price if r.running() else 0.0
        cost = price * hours
        for part in (report.by_market.setdefault(r.market.value, Part()), report.by_cloud.setdefault(r.cloud, Part())):
            part.cost_so_far += cost
            part.cost_per_hour += per_hour
            part.replica_hours += hours
            part.replicas += 1
        report.cost_so_far += cost
        report.cost_per_hour += per_hour
        report.replica_hours += hours
        report.on_demand_equivalent += on_demand * hours
        report.on_demand_equivalent_per_hour += on_demand if r.running() else 0.0
        if tokens is not None:
            report.cost_since_tokens += price * r.hours(now, since=tokens.since)
        report.replicas.append({
            "replica_id": r.replica_id, "cloud": r.cloud, "zone": r.zone, "market": r.market.value,
            "price_per_hour": price, "on_demand_price_per_hour": on_demand, "hours": hours, "cost": cost,
            "running": r.running(),
        })
    report.savings = report.on_demand_equivalent - report.cost_so_far
    if report.on_demand_equivalent > 0:
        report.savings_fraction = report.savings / report.on_demand_equivalent
    if tokens is not None and tokens.output_tokens > 0:
        report.cost_per_million_output_tokens = report.cost_since_tokens / tokens.output_tokens * 1e6
    return report


def quote_lookup(offers: Iterable[Offer]) -> Quote:
    """A Quote over these offers: the cheapest one for the exact location and instance type,
    else for the instance type anywhere in the region, else (a replica whose instance type is
    not known) anything in the location."""
    exact: dict[tuple, float] = {}
    regional: dict[tuple, float] = {}
    located: dict[tuple, float] = {}
    for o in offers:
        loc, market = o.location, Market(o.market)
        for table, key in ((exact, (loc.cloud, loc.region, loc.zone, o.instance_type, market)),
                           (regional, (loc.cloud, loc.region, o.instance_type, market)),
                           (located, (loc.cloud, loc.region, loc.zone, market))):
            table[key] = min(table.get(key, o.price_per_hour), o.price_per_hour)

    def quote(cloud: str, region: str, zone: str, instance_type: str | None, market: Market) -> float | None:
        if instance_type:
            found = exact.get((cloud, region, zone, instance_type, market))
            return found if found is not None else regional.get((cloud, region, instance_type, market))
        return located.get((cloud, region, zone, market))

    return quote


def billed_replicas(rows: Iterable, transitions: Iterable) -> list[Billed]:
    """Billed intervals of replica rows (orchestrator.control.store.ReplicaRow); a terminal
    row ends at its first transition event into a terminal state (its `updated_at` when the
    events are gone)."""
    ended: dict[str, float] = {}
    for e in transitions:
        if e.replica_id not in ended and json.loads(e.data_json or "{}").get("to") in _TERMINAL:
            ended[e.replica_id] = e.at
    out = []
    for r in rows:
        end = ended.get(r.replica_id, r.updated_at) if r.state in _TERMINAL else None
        out.append(Billed(r.replica_id, r.cloud, r.region, r.zone, Market(r.market), r.instance_type,
                          r.price_per_hour, r.launched_at, end))
    return out


def summary(report: Mapping) -> str:
    """One line of a report (as_dict): for the event recorded when a service is deleted."""
    return f"cost ${report['cost_so_far']:.4f} over {report['replica_hours']:.2f} replica-hours " \
           f"(on demand: ${report['on_demand_equivalent']:.4f})"
