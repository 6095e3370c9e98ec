"""The offline optimum: the cheapest schedule that knows the whole trace and never drops below
the target, as a mixed-integer program (scipy's `milp`, HiGHS).

Time is cut where any zone's capacity or price changes (and a cold start after each rise of
capacity); a schedule holds whole replicas per zone and segment, each serving only after a
cold start spent holding it (billed, and counted against the zone's capacity). The same
program scores both models: the replay engine's (trace ticks, per-second billing from t = 0)
and the paper model's (30 s ticks, billing from the cold start on). docs/simulator.md gives
the formulation. Called by `spotctl simulate --optimal` and the policy benchmark; needs the
`optimum` extra (scipy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from orchestrator.common.errors import UserError
from orchestrator.sim.paper import MODEL, TICK, PaperConfig, expand
from orchestrator.sim.replay import SimConfig, SimResult
from orchestrator.sim.traces import TraceGroup

SOLVER_MISSING = "the offline optimum needs scipy: pip install 'spot-orchestrator[optimum]'"
OPTIMAL = "optimal"  # the name its results carry in place of a policy's


@dataclasses.dataclass(frozen=True)
class Optimum:
    cost: float  # $ over the billed span
    spot_replica_seconds: float
    on_demand_replica_seconds: float
    segments: int
    status: str  # HiGHS's message


def solve(
    capacity: Sequence[np.ndarray],
    prices: Sequence[np.ndarray],
    gap: float,
    cold_start: float,
    target: int,
    od_price: float,
    bill_from: float = 0.0,
    unheld: float = 0.0,
    time_limit: float = 600.0,
) -> Optimum:
    """Cheapest schedule with `target` replicas serving from `cold_start` to the end.

    capacity[z][j], prices[z][j] ($/hour): zone z during tick j (length `gap`). On-demand is
    always granted at `od_price`. Time before `bill_from` is free. A spot replica holds zone
    capacity from `unheld` seconds after it was asked for (the replay grants a launch after
    its attempt). Raises UserError if scipy is missing or the solver finds no schedule.
    """
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:
        raise UserError(SOLVER_MISSING) from None
    caps = [np.asarray(c, dtype=np.int64) for c in capacity]
    rates = [np.asarray(p, dtype=float) / 3600.0 for p in prices]
    ticks = len(caps[0])
    end = ticks * gap
    c = min(cold_start, end)
    # Segment boundaries: where anything changes, and a cold start after capacity appears.
    changed = np.zeros(ticks, dtype=bool)
    rose = np.zeros(ticks, dtype=bool)
    for cap, rate in zip(caps, rates, strict=True):
        changed[1:] |= (cap[1:] != cap[:-1]) | (rate[1:] != rate[:-1])
        rose[1:] |= cap[1:] > cap[:-1]
    points = {0.0, c, end}
    points.update(float(j) * gap for j in np.flatnonzero(changed))
    points.update(float(j) * gap + c - min(unheld, c) for j in np.flatnonzero(rose))
    bounds = np.array(sorted(p for p in points if 0.0 <= p <= end))
    starts, ends = bounds[:-1], bounds[1:]
    nseg = len(starts)
    tick_of = np.minimum((starts // gap).astype(np.int64), ticks - 1)  # capacity is constant in a segment
    first = int(np.searchsorted(starts, c))  # first serving segment (starts at c)

    # cum[z](t): $ per replica from 0 to t, for exact partial-tick billing.
    def spent(z: int | None, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
        t0, t1 = np.maximum(t0, bill_from), np.maximum(t1, bill_from)
        if z is None:
            return od_price / 3600.0 * (t1 - t0)
        cum = np.concatenate([[0.0], np.cumsum(rates[z] * gap)])

        def at(t):
            j = np.minimum((t // gap).astype(np.int64), ticks - 1)
            return cum[j] + rates[z][j] * (t - j * gap)

        return at(t1) - at(t0)

    serving = np.arange(first, nseg)
    prep_start = starts[serving] - c
    # The segments in which a run that serves from a segment's start holds capacity first.
    lo_seg = np.searchsorted(ends, prep_start + min(unheld, c), side="right")
    cost, lb, ub, integral = [], [], [], []
    rows, cols, vals, rlo, rhi = [], [], [], [], []
    nrow = 0

    def var(price: float, upper: float, integer: bool) -> int:
        cost.append(price)
        lb.append(0.0)
        ub.append(upper)
        integral.append(1 if integer else 0)
        return len(cost) - 1

    def row(terms, lo, hi) -> None:
        nonlocal nrow
        for j, v in terms:
            rows.append(nrow)
            cols.append(j)
            vals.append(v)
        rlo.append(lo)
        rhi.append(hi)
        nrow += 1

    coverage: list[list[tuple[int, float]]] = [[] for _ in serving]
    spot_vars: list[tuple[int, int, int]] = []  # (s index, n index, segment) for reporting
    for z in range(len(caps)):
        seg_cap = caps[z][tick_of]
        serve_cost = spent(z, starts[serving], ends[serving])
        prep_cost = spent(z, prep_start, starts[serving])
        # s: replicas serving in zone z during a segment; n: runs that begin serving at its start.
        load: dict[int, list[int]] = {}  # segment -> the variables holding a replica of z in it
        prev_s = None
        for i, k in enumerate(serving):
            cap_k = min(int(seg_cap[k]), target)
            if cap_k == 0:
                prev_s = None
                continue
            prep_ok = bool(np.all(seg_cap[lo_seg[i] : k] > 0))
            s = var(serve_cost[i], cap_k, True)
            n = var(prep_cost[i], target if prep_ok else 0, False)
            coverage[i].append((s, 1.0))
            spot_vars.append((s, n, k))
            # n >= s - s_prev: a replica serves only after a cold start held in the zone.
            row([(n, 1.0), (s, -1.0)] + ([(prev_s, 1.0)] if prev_s is not None else []), 0.0, np.inf)
            load.setdefault(k, []).append(s)
            if prep_ok:
                for k2 in range(lo_seg[i], k):
                    load.setdefault(k2, []).append(n)
            prev_s = s
        for k2, members in load.items():
            if seg_cap[k2] < 2 * target:  # else it can never bind
                row([(m, 1.0) for m in members], -np.inf, float(seg_cap[k2]))
    od_serve = spent(None, starts[serving], ends[serving])
    od_prep = spent(None, prep_start, starts[serving])
    prev_o = None
    od_vars = []
    for i in range(len(serving)):
        o = var(od_serve[i], target, True)
        n = var(od_prep[i], target, False)
        od_vars.append((o, n))
        row([(n, 1.0), (o, -1.0)] + ([(prev_o, 1.0)] if prev_o is not None else []), 0.0, np.inf)
        coverage[i].append((o, 1.0))
        prev_o = o
    for terms in coverage:
        row(terms, target, np.inf)
    a = coo_matrix((vals, (rows, cols)), shape=(nrow, len(cost))).tocsr()
    res = milp(
        c=np.array(cost),
        constraints=LinearConstraint(a, np.array(rlo), np.array(rhi)),
        integrality=np.array(integral),
        bounds=Bounds(np.array(lb), np.array(ub)),
        options={"time_limit": time_limit, "disp": False, "mip_rel_gap": 1e-6},
    )
    if res.x is None:
        raise UserError(f"offline optimum: no schedule found ({res.message})")
    x = res.x
    length = ends - starts
    prep_len = np.maximum(starts[serving], bill_from) - np.maximum(prep_start, bill_from)
    spot_s = sum(x[s] * length[k] + x[n] * prep_len[k - first] for s, n, k in spot_vars)
    od_s = sum(x[o] * length[serving[i]] + x[n] * prep_len[i] for i, (o, n) in enumerate(od_vars))
    return Optimum(float(res.fun), float(spot_s), float(od_s), nseg, str(res.message))


def replay_optimum(group: TraceGroup, config: SimConfig, label: str | None = None) -> SimResult:
    """The optimum in the replay engine's model, scored like a replay (same baseline). Raises
    UserError if scipy is missing."""
    n = group.ticks
    od = min(config.od_price_ratio * sum(z.spot_prices) / n for z in group.zones)
    opt = solve(
        [np.asarray(z.capacity) for z in group.zones],
        [np.asarray(z.spot_prices) for z in group.zones],
        group.gap, config.cold_start, config.target, od,
        unheld=max(1.0, min(config.attempt, config.cold_start)),
    )
    baseline = config.target * od * group.duration / 3600.0
    return _result(group, label, opt, baseline, group.duration, "replay")


def paper_optimum(group: TraceGroup, config: PaperConfig, label: str | None = None) -> SimResult:
    """The optimum in the paper model: each window solved alone, cost ratios averaged as the
    paper model averages a policy's. Raises UserError if scipy is missing."""
    trace = expand(group, config)
    cold = config.cold_ticks * TICK
    od = config.od_price_ratio * trace.spot_price
    baseline_per_window = config.target * od * (trace.window_ticks * TICK - cold) / 3600.0
    ratios, total = [], None
    for offset in trace.offsets:
        caps = [trace.capacity[z][offset : offset + trace.window_ticks] for z in trace.zones]
        prices = [np.full(trace.window_ticks, trace.spot_price) for _ in caps]
        opt = solve(caps, prices, TICK, cold, config.target, od, bill_from=cold)
        ratios.append(opt.cost / baseline_per_window)
        total = opt if total is None else dataclasses.replace(
            total,
            cost=total.cost + opt.cost,
            spot_replica_seconds=total.spot_replica_seconds + opt.spot_replica_seconds,
            on_demand_replica_seconds=total.on_demand_replica_seconds + opt.on_demand_replica_seconds,
        )
    windows = len(trace.offsets)
    result = _result(group, label, total, baseline_per_window * windows, windows * trace.window_ticks * TICK, MODEL)
    result.cost_ratio = sum(ratios) / len(ratios)
    return result


def _result(group: TraceGroup, label: str | None, opt: Optimum, baseline: float, span: float, model: str) -> SimResult:
    gpus = group.gpus_per_replica
    return SimResult(
        policy=OPTIMAL,
        trace=label or group.name,
        cost_ratio=opt.cost / baseline if baseline > 0 else 0.0,
        availability=1.0,
        spot_gpu_hours=opt.spot_replica_seconds * gpus / 3600.0,
        on_demand_gpu_hours=opt.on_demand_replica_seconds * gpus / 3600.0,
        preemptions=0,
        launches=0,
        capacity_errors=0,
        notices=0,
        cost=opt.cost,
        on_demand_baseline_cost=baseline,
        simulated_seconds=span,
        model=model,
    )
