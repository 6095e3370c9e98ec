"""`spotctl cost [SERVICE] [--json]`: what each service has cost, from the daemon's GET /v1/cost.

The arithmetic is the daemon's (orchestrator.control.costing); this module only prints it: one
row per service, then one per market and cloud of each.
"""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.cli.client import DaemonClient

console = Console(width=None if sys.stdout.isatty() else 200)


def _money(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"${value:.{digits}f}"


def cost(
    service: str = typer.Argument(None, help="Only this service."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """What services have cost: so far, per hour, by market and cloud, saved vs on demand, $/M output tokens."""
    client = DaemonClient.connect(start=True)
    reports = [client.get(f"/v1/cost/{service}")] if service else client.get("/v1/cost")
    if as_json:
        typer.echo(json.dumps(reports[0] if service else reports, indent=2))
        return
    if not reports:
        console.print("no services (start one with `spotctl up service.yaml`)")
        return
    st = Table(title="Cost", title_justify="left")
    for col in ("SERVICE", "SO FAR", "PER HOUR", "REPLICA-H", "ON DEMAND", "SAVED", "OUT TOKENS", "$/M TOKENS"):
        st.add_column(col)
    for r in reports:
        saved = f"{_money(r['savings'])} ({r['savings_fraction']:.0%})" if r["savings_fraction"] is not None else "-"
        tokens = "-" if r["output_tokens"] is None else str(r["output_tokens"])
        st.add_row(r["service"], _money(r["cost_so_far"]), _money(r["cost_per_hour"]), f"{r['replica_hours']:.2f}",
                   _money(r["on_demand_equivalent"]), saved, tokens, _money(r["cost_per_million_output_tokens"], 2))
    console.print(st)
    bt = Table(title="By market and cloud", title_justify="left")
    for col in ("SERVICE", "BY", "", "REPLICAS", "SO FAR", "PER HOUR", "REPLICA-H"):
        bt.add_column(col)
    for r in reports:
        for by, parts in (("market", r["by_market"]), ("cloud", r["by_cloud"])):
            for name, part in sorted(parts.items()):
                bt.add_row(r["service"], by, name, str(part["replicas"]), _money(part["cost_so_far"]),
                           _money(part["cost_per_hour"]), f"{part['replica_hours']:.2f}")
    console.print(bt)
    for r in reports:
        if r["unpriced"]:
            console.print(f"{r['service']}: no price known for {', '.join(r['unpriced'])} (counted as $0)")


def register(app: typer.Typer) -> None:
    app.command()(cost)
