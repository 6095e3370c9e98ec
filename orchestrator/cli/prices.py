"""`spotctl prices`: the GPU price book, live where credentials allow, else SkyPilot's catalog.

Each row says where its prices came from (live, catalog, snapshot) and how old they are.
`--refresh` first replaces the catalog files with SkyPilot's hosted ones (bounded by a timeout;
offline it says so in one line and keeps the files it has). docs/prices.md explains the sources.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.common.errors import UserError
from providers.base import Market, Offer, ProviderError
from providers.catalog import loader
from providers.catalog.loader import CLOUDS
from orchestrator.control.pricebook import provenance
from providers.prices import live_offers

# Piped output (scripts, CI logs) gets room for every column instead of 80 truncated ones.
console = Console(width=None if sys.stdout.isatty() else 170)


@dataclass
class Row:
    """One instance type in one location, both markets side by side."""

    offer: Offer  # either market's quote: location, type, accelerator
    spot: Offer | None = None
    on_demand: Offer | None = None

    @property
    def spot_price(self) -> float | None:
        return self.spot.price_per_hour if self.spot else None

    @property
    def on_demand_price(self) -> float | None:
        return self.on_demand.price_per_hour if self.on_demand else None

    @property
    def best(self) -> float:
        return self.spot_price if self.spot_price is not None else (self.on_demand_price or 0.0)

    @property
    def discount(self) -> float | None:
        if self.spot_price is None or not self.on_demand_price:
            return None
        return 1 - self.spot_price / self.on_demand_price

    @property
    def source(self) -> str:
        return "+".join(sorted({q.source or "unknown" for q in (self.spot, self.on_demand) if q}))

    @property
    def observed_at(self) -> float:
        """When the older of the row's two prices was taken."""
        return min(q.observed_at for q in (self.spot, self.on_demand) if q)

    def as_json(self, now: float) -> dict:
        loc = self.offer.location
        return {"cloud": loc.cloud, "region": loc.region, "zone": loc.zone, "instance_type": self.offer.instance_type,
                "accelerator": self.offer.accelerator, "accelerator_count": self.offer.accelerator_count,
                "spot_price": self.spot_price, "on_demand_price": self.on_demand_price,
                "discount": None if self.discount is None else round(self.discount, 4),
                "price_per_gpu_hour": round(self.best / max(1, self.offer.accelerator_count), 6),
                "source": self.source, "observed_at": self.observed_at,
                "age_s": round(max(0.0, now - self.observed_at), 1),
                "spot": provenance(self.spot, now) if self.spot else None,
                "on_demand": provenance(self.on_demand, now) if self.on_demand else None}


def parse_gpu(text: str | None) -> tuple[str | None, int | None]:
    """"A100" -> ("A100", None); "A100:8" -> ("A100", 8)."""
    if not text:
        return None, None
    name, _, count = text.partition(":")
    if not name or (count and (not count.isdigit() or int(count) < 1)):
        raise UserError(f"--gpu {text!r}: expected NAME or NAME:COUNT, e.g. A100 or A100:8")
    return name, int(count) if count else None


def parse_clouds(text: str | None) -> list[str]:
    if not text:
        return list(CLOUDS)
    clouds = [c.strip().lower() for c in text.split(",") if c.strip()]
    bad = [c for c in clouds if c not in CLOUDS]
    if bad or not clouds:
        raise UserError(f"--cloud {text!r}: expected a comma-separated list of {', '.join(CLOUDS)}")
    return clouds


def collect(clouds: list[str], gpu: str | None, count: int | None, regions: list[str] | None,
            live: bool = True) -> list[Row]:
    offers: list[Offer] = []
    offline = []
    for cloud in clouds:
        got = None
        if live:
            try:
                got = live_offers(cloud, gpu, count, regions)
            except ProviderError as err:
                typer.echo(f"{cloud}: live prices failed ({err}); showing the catalog's", err=True)
            if got is not None:
                offers += got
                continue
            offline.append(cloud)
        try:
            offers += loader.catalog_offers(cloud, gpu, count)
        except loader.CatalogError as err:
            raise UserError(str(err)) from None
    if offline:
        typer.echo(f"no credentials for {', '.join(offline)}: showing SkyPilot's catalog prices "
                   f"({loader.catalog_dir()}; `spotctl prices --refresh` updates it)", err=True)
    return _rows(offers, gpu, count, regions)


def _rows(offers: list[Offer], gpu: str | None, count: int | None, regions: list[str] | None) -> list[Row]:
    rows: dict[tuple, Row] = {}
    wanted_regions = set(regions) if regions else None
    for offer in offers:
        if gpu and offer.accelerator.lower() != gpu.lower():
            continue
        if count and offer.accelerator_count != count:
            continue
        if wanted_regions and offer.location.region not in wanted_regions:
            continue
        row = rows.setdefault((offer.location, offer.instance_type), Row(offer))
        if offer.market is Market.SPOT:
            row.spot = offer
        else:
            row.on_demand = offer
    return sorted(rows.values(), key=lambda r: (r.best, str(r.offer.location), r.offer.instance_type))


def refresh_catalogs(clouds: list[str]) -> None:
    """Replace the clouds' catalog files with SkyPilot's hosted ones; one stderr line per failure."""
    for cloud, error in loader.refresh(clouds).items():
        if error:
            typer.echo(f"{cloud}: catalog not refreshed ({error}); keeping the one from "
                       f"{time.strftime('%Y-%m-%d', time.gmtime(loader.provenance(cloud).observed_at))}", err=True)


def _age(ts: float) -> str:
    secs = max(0.0, time.time() - ts)
    unit, size = next(((u, s) for u, s in (("d", 86400), ("h", 3600), ("m", 60)) if secs >= s), ("s", 1))
    return f"{secs / size:.0f}{unit}"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _table(rows: list[Row]) -> Table:
    table = Table(title="GPU offers, cheapest first")
    for name, justify in [("cloud", "left"), ("region", "left"), ("zone", "left"), ("instance type", "left"),
                          ("GPUs", "left"), ("spot $/h", "right"), ("on-demand $/h", "right"),
                          ("discount", "right"), ("$/GPU-h", "right"), ("source", "left"), ("age", "right")]:
        table.add_column(name, justify=justify)
    for row in rows:
        loc, offer = row.offer.location, row.offer
        table.add_row(loc.cloud, loc.region, loc.zone, offer.instance_type,
                      f"{offer.accelerator}:{offer.accelerator_count}", _money(row.spot_price),
                      _money(row.on_demand_price), "-" if row.discount is None else f"{row.discount:.0%}",
                      f"{row.best / max(1, offer.accelerator_count):.4f}", row.source, _age(row.observed_at))
    return table


def _history(spec: str, cloud: str | None, as_json: bool) -> None:
    zone, _, itype = spec.partition("/")
    if not zone or not itype:
        raise UserError(f"--history {spec!r}: expected ZONE/TYPE, e.g. us-east-1a/p4d.24xlarge")
    from orchestrator.control.pricebook import load_history
    from orchestrator.control.store import Store

    store = Store()
    try:
        quotes = load_history(store, zone, itype, cloud=cloud)
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps([{"cloud": q.location.cloud, "region": q.location.region, "zone": q.location.zone,
                                "instance_type": q.instance_type, "accelerator": q.accelerator,
                                "accelerator_count": q.accelerator_count, "market": q.market.value,
                                "price_per_hour": q.price_per_hour, "observed_at": q.observed_at} for q in quotes]))
        return
    if not quotes:
        console.print(f"no stored price history for {zone}/{itype} (the daemon records it as it refreshes prices)")
        return
    table = Table(title=f"price history of {itype} in {zone}")
    for name in ("observed", "market", "$/h"):
        table.add_column(name)
    for q in quotes:
        table.add_row(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(q.observed_at)), q.market.value,
                      f"{q.price_per_hour:.4f}")
    console.print(table)


def prices(
    gpu: str = typer.Option(None, "--gpu", help="Accelerator, optionally with a count: A100 or A100:8."),
    cloud: str = typer.Option(None, "--cloud", help="Comma-separated clouds (default: aws,gcp,azure)."),
    region: list[str] = typer.Option(None, "--region", help="Only these regions (repeat or comma-separate)."),
    spot_only: bool = typer.Option(False, "--spot-only", help="Only offers with a spot price."),
    history: str = typer.Option(None, "--history", help="Show the stored history of ZONE/TYPE instead."),
    limit: int = typer.Option(40, "--limit", help="Rows in the table (--json prints all)."),
    offline: bool = typer.Option(False, "--offline", help="Use the catalog prices even with credentials."),
    refresh: bool = typer.Option(False, "--refresh", help="First fetch SkyPilot's current catalogs (network)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array."),
) -> None:
    """Spot and on-demand GPU prices across clouds, cheapest first."""
    clouds = parse_clouds(cloud)
    if history:
        _history(history, clouds[0] if cloud and len(clouds) == 1 else None, as_json)
        return
    name, count = parse_gpu(gpu)
    regions = [r.strip() for item in (region or []) for r in item.split(",") if r.strip()]
    if refresh:
        refresh_catalogs(clouds)
    rows = collect(clouds, name, count, regions or None, live=not offline)
    if spot_only:
        rows = [r for r in rows if r.spot is not None]
    if as_json:
        now = time.time()
        typer.echo(json.dumps([r.as_json(now) for r in rows]))
        return
    if not rows:
        console.print("no offers match" + (f" --gpu {gpu}" if gpu else "") + (f" --region {region}" if region else ""))
        return
    console.print(_table(rows[:limit]))
    if len(rows) > limit:
        console.print(f"{len(rows) - limit} more rows: use --limit or --json", style="dim")
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command("prices")(prices)
