"""`spotctl simulate` (replay spot traces against placement policies) and `spotctl policies`."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.common.errors import UserError
from orchestrator.common.paths import traces_dir
from orchestrator.sim.paper import MODEL as PAPER_MODEL
from orchestrator.sim.paper import PaperConfig, run_paper_matrix
from orchestrator.sim.replay import SKYSERVE_EVAL_PARAMS, SimConfig, SimResult, run_matrix
from orchestrator.sim.traces import labelled_groups, load_price_table
from orchestrator.sim.traces import one_market as markets
from policies.base import DEFAULT_POLICY, available_policies

console = Console(width=None if sys.stdout.isatty() else 170)
REPLAY_MODEL = "replay"
MODELS = (REPLAY_MODEL, PAPER_MODEL)


def _split(values: list[str] | None, what: str) -> list[str]:
    out = [v.strip() for item in values or [] for v in item.split(",") if v.strip()]
    if not out:
        raise UserError(f"{what}: give at least one")
    return out


def simulate(
    trace: list[str] = typer.Option(
        None, "--trace", help="Trace folder, or a folder of them (repeatable; default: the shared traces)."
    ),
    policy: list[str] = typer.Option(
        None, "--policy", help="Policy name(s), repeatable or comma-separated; 'default' = the default policy."
    ),
    model: str = typer.Option(
        REPLAY_MODEL, "--model",
        help=f"'{REPLAY_MODEL}' (event-driven, with notices) or '{PAPER_MODEL}' (the SpotHedge artifact's).",
    ),
    target: int = typer.Option(3, "--target", help="READY replicas the service wants."),
    cold_start: float = typer.Option(120.0, "--cold-start", help="Seconds from launch to READY."),
    notice: float = typer.Option(
        None, "--notice", help="Seconds of warning before a preemption (0: none; default: the trace's cloud's)."
    ),
    od_price_ratio: float = typer.Option(3.0, "--od-price-ratio", help="On-demand price as a multiple of spot."),
    overprovision: int = typer.Option(
        SKYSERVE_EVAL_PARAMS.num_overprovision, "--overprovision", help="Service num_overprovision (SpotHedge's)."
    ),
    prices: Path = typer.Option(None, "--prices", help="JSON {zone | ZONE_KIND | kind: spot $/hour}."),
    optimal: bool = typer.Option(False, "--optimal", help="Add the offline optimum (needs scipy) per trace."),
    windows: int = typer.Option(10, "--windows", help=f"{PAPER_MODEL}: 24 h windows drawn per trace."),
    seed: int = typer.Option(0, "--seed", help=f"{PAPER_MODEL}: the windows' and zone shuffles' seed."),
    sample_seconds: float = typer.Option(
        None, "--sample-seconds", help=f"{PAPER_MODEL}: seconds each trace sample lasts (default: the artifact's)."
    ),
    zone_order: str = typer.Option(
        None, "--zone-order", help=f"{PAPER_MODEL}: comma-separated zones, their order before the first shuffle."
    ),
    one_market: bool = typer.Option(
        False, "--one-market", help="Replay the traces as one market (several clouds, each zone its own prices)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array, one object per policy and trace."),
    plot: Path = typer.Option(None, "--plot", help="Write a PNG of READY replicas and cost over time (replay)."),
) -> None:
    """Replay spot traces: cost (vs all on-demand) and availability of each policy."""
    traces = _split(trace or [str(traces_dir())], "--trace")
    names = _split(policy or ["spothedge", "default"], "--policy")
    if model not in MODELS:
        raise UserError(f"--model must be one of {', '.join(MODELS)}, got {model!r}")
    if overprovision < 0:
        raise UserError(f"--overprovision must be >= 0, got {overprovision}")
    params = dataclasses.replace(SKYSERVE_EVAL_PARAMS, num_overprovision=overprovision)
    price_table = load_price_table(prices)
    if model == PAPER_MODEL:
        for flag, value in (("--notice", notice), ("--plot", plot)):
            if value is not None:
                raise UserError(f"{flag} does not apply to --model {PAPER_MODEL} (preemptions come without notice)")
        if one_market:
            raise UserError(f"--one-market does not apply to --model {PAPER_MODEL} (one spot price everywhere)")
        config = PaperConfig(
            target=target, cold_start=cold_start, od_price_ratio=od_price_ratio, windows=windows, seed=seed,
            sample_seconds=sample_seconds, params=params,
            zone_order=tuple(_split([zone_order], "--zone-order")) if zone_order is not None else (),
        )
        results = run_paper_matrix(traces, names, config, price_table)
    else:
        for flag, value in (("--sample-seconds", sample_seconds), ("--zone-order", zone_order)):
            if value is not None:
                raise UserError(f"{flag} applies to --model {PAPER_MODEL} only")
        if plot:
            _pyplot()
        config = SimConfig(
            target=target, cold_start=cold_start, notice=notice, od_price_ratio=od_price_ratio, params=params,
            series_points=1500 if plot else 0,
        )
        results = run_matrix(traces, names, config, price_table, merged=one_market)
    if optimal:
        groups = (markets if one_market else labelled_groups)(traces, price_table)
        results = _with_optimum(results, groups, config, len(names))
    if plot:
        _plot(results, plot)
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in results]))
        return
    notice_text = "notice per cloud" if notice is None else f"notice {notice:g}s"
    title = f"{model}: target {target}, cold start {cold_start:g}s, od {od_price_ratio:g}x"
    if model == REPLAY_MODEL:
        title += f", {notice_text}"
    table = Table(title=title)
    for col in ("trace", "policy"):
        table.add_column(col)
    for col in ("cost ratio", "availability", "spot GPU-h", "on-demand GPU-h", "preempted", "launches",
                "launches/preemption"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.trace, r.policy, f"{r.cost_ratio:.3f}", f"{r.availability:.4f}", f"{r.spot_gpu_hours:,.0f}",
            f"{r.on_demand_gpu_hours:,.0f}", str(r.preemptions), str(r.launches), f"{r.launches_per_preemption:.2f}",
        )
    console.print(table)
    if plot:
        console.print(f"plot written to {plot}")


def _with_optimum(results: list[SimResult], groups, config, per_trace: int) -> list[SimResult]:
    """The results with each trace's offline optimum after its policies' rows."""
    from orchestrator.sim.optimum import paper_optimum, replay_optimum

    solve = paper_optimum if isinstance(config, PaperConfig) else replay_optimum
    out = []
    for i, (label, group) in enumerate(groups):
        out += results[i * per_trace : (i + 1) * per_trace]
        out.append(solve(group, config, label))
    return out


PLOT_MISSING = "install the plot extra: pip install 'spot-orchestrator[plot]'"


def _pyplot():
    """matplotlib's pyplot (headless), or a UserError when the `plot` extra is not installed.
    Asked before the replay runs (so a missing extra costs no simulation), and again to draw."""
    try:
        import matplotlib
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(PLOT_MISSING) from None
    matplotlib.use("Agg")
    return plt


def _plot(results: list[SimResult], path: Path) -> None:
    plt = _pyplot()
    traces = list(dict.fromkeys(r.trace for r in results))
    fig, axes = plt.subplots(len(traces), 2, figsize=(12, 3 * len(traces)), squeeze=False)
    for row, trace in enumerate(traces):
        ready_ax, cost_ax = axes[row]
        for r in (r for r in results if r.trace == trace):
            hours = [t / 3600.0 for t, _, _ in r.series]
            ready_ax.step(hours, [n for _, n, _ in r.series], where="post", label=r.policy, linewidth=0.8)
            cost_ax.plot(hours, [c for _, _, c in r.series], label=f"{r.policy} ({r.cost_ratio:.2f})")
        ready_ax.set_title(f"{trace}: serving replicas", fontsize=9)
        cost_ax.set_title(f"{trace}: cumulative cost ($)", fontsize=9)
        for ax in (ready_ax, cost_ax):
            ax.set_xlabel("hours")
            ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as err:
        raise UserError(f"--plot {path}: cannot write: {err}") from None
    finally:
        plt.close(fig)


def policies(as_json: bool = typer.Option(False, "--json", help="Print a JSON array.")) -> None:
    """The registered placement policies (entry-point group spot_orchestrator.policies)."""
    listed = available_policies()
    rows = [{"name": n, "default": n == DEFAULT_POLICY, "description": d} for n, d in listed.items()]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    table = Table()
    table.add_column("policy")
    table.add_column("description")
    for r in rows:
        table.add_row(r["name"] + (" (default)" if r["default"] else ""), r["description"])
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
    app.command("policies")(policies)
