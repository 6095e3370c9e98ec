"""The local cloud's zones: one region ("local") and its zones, each with a spot and an
on-demand price. `configured_locations()` reads them without starting a provider."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.common import paths
from providers.base import Location, ProviderError

CLOUD = "local"
REGION = "local"


@dataclasses.dataclass(frozen=True)
class ZonePrices:
    spot: float
    on_demand: float


# Spot well below on-demand, and different per zone so that price-aware policies have a choice.
DEFAULT_ZONES: dict[str, ZonePrices] = {
    "local-a": ZonePrices(spot=0.30, on_demand=1.00),
    "local-b": ZonePrices(spot=0.36, on_demand=1.00),
    "local-c": ZonePrices(spot=0.42, on_demand=1.10),
}


def default_root() -> Path:
    return paths.home() / "local-cloud"


def zones_from_json(data: Mapping[str, Any]) -> dict[str, ZonePrices]:
    return {zone: ZonePrices(float(p["spot"]), float(p["on_demand"])) for zone, p in data.items()}


def configured_locations(root: Path | None = None) -> list[Location]:
    """The local cloud's zones (as last configured by a LocalProvider), without starting one."""
    path = (root or default_root()) / "zones.json"
    try:
        zones = zones_from_json(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        zones = DEFAULT_ZONES
    return [Location(CLOUD, REGION, zone) for zone in zones]


def normalize_zones(zones: Mapping[str, ZonePrices] | Sequence[str]) -> dict[str, ZonePrices]:
    if isinstance(zones, Mapping):
        out = dict(zones)
    else:  # names only: staggered prices so the zones still differ
        out = {
            zone: ZonePrices(spot=round(0.30 + 0.06 * i, 2), on_demand=1.00) for i, zone in enumerate(zones)
        }
    if not out:
        raise ProviderError("the local cloud needs at least one zone")
    return out


def zones_to_json(zones: Mapping[str, ZonePrices]) -> dict[str, dict[str, float]]:
    return {zone: dataclasses.asdict(p) for zone, p in zones.items()}
