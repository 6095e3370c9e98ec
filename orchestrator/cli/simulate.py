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
from orchestrator.sim.replay import SKYSERVE_EVAL_PARAMS, SimConfig, SimResult, load_price_table, run_matrix
from policies.base import DEFAULT_POLICY, available_policies

console = Console(width=None if sys.stdout.isatty() else 170)


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
    target: int = typer.Option(3, "--target", help="READY replicas the service wants."),
    cold_start: float = typer.Option(120.0, "--cold-start", help="Seconds from launch to READY."),
    notice: float = typer.Option(120.0, "--notice", help="Seconds of warning before a preemption (0: none)."),
    od_price_ratio: float = typer.Option(3.0, "--od-price-ratio", help="On-demand price as a multiple of spot."),
    overprovision: int = typer.Option(
        SKYSERVE_EVAL_PARAMS.num_overprovision, "--overprovision", help="Service num_overprovision (SpotHedge's)."
    ),
    prices: Path = typer.Option(None, "--prices", help="JSON {zone | ZONE_KIND | kind: spot $/hour}."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array, one object per policy and trace."),
    plot: Path = typer.Option(None, "--plot", help="Write a PNG of READY replicas and cost over time."),
) -> None:
    """Replay spot traces: cost (vs all on-demand) and availability of each policy."""
    traces = _split(trace or [str(traces_dir())], "--trace")
    names = _split(policy or ["spothedge", "default"], "--policy")
    if overprovision < 0:
        raise UserError(f"--overprovision must be >= 0, got {overprovision}")
    params = dataclasses.replace(SKYSERVE_EVAL_PARAMS, num_overprovision=overprovision)
    config = SimConfig(
        target=target,
        cold_start=cold_start,
        notice=notice,
        od_price_ratio=od_price_ratio,
        params=params,
        series_points=1500 if plot else 0,
    )
    results = run_matrix(traces, names, config, load_price_table(prices))
    if plot:
        _plot(results, plot)
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in results]))
        return
    table = Table(title=f"target {target}, cold start {cold_start:g}s, notice {notice:g}s, od {od_price_ratio:g}x")
    for col in ("trace", "policy"):
        table.add_column(col)
    for col in ("cost ratio", "availability", "spot GPU-h", "on-demand GPU-h", "preempted", "launches"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.trace, r.policy, f"{r.cost_ratio:.3f}", f"{r.availability:.4f}", f"{r.spot_gpu_hours:,.0f}",
            f"{r.on_demand_gpu_hours:,.0f}", str(r.preemptions), str(r.launches),
        )
    console.print(table)
    if plot:
        console.print(f"plot written to {plot}")


def _plot(results: list[SimResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
