"""Spot traces: loading trace folders into trace groups, and the spot price table.

A trace folder holds one JSON file per zone and instance kind (ZONE_KIND.json: a
`gap_seconds`, the count of instances the zone let one hold at each tick, optional
prices). A trace group is one folder, or one instance kind of a mixed folder: the zones a
policy chooses from, cut to their common prefix. The cloud comes from the folder's name.
`merge_groups` makes several groups (several clouds' traces) one market.
Used by the replay engine (orchestrator.sim.replay), the paper model (orchestrator.sim.paper),
the offline optimum, `spotctl simulate` and the policy benchmark.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from pathlib import Path

from orchestrator.common.errors import UserError
from providers.base import Location
from providers.notice import cloud_of_name

# Nominal spot $/hour per instance kind (file-name suffix) for traces without prices.
# cost ratios depend only on ratios, so these matter only where zones differ; p3.2xlarge's
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
GPU_KINDS = ("v100", "k80", "a100", "h100", "t4", "l4", "a10g")


@dataclasses.dataclass(frozen=True)
class ZoneTrace:
    location: Location
    capacity: list[int]
    spot_prices: list[float]  # $/hour per tick, same length as capacity
    kind: str = ""  # the zone's instance kind where a merged group mixes kinds ("": the group's)


@dataclasses.dataclass(frozen=True)
class TraceGroup:
    """One folder (or one instance kind of a mixed folder): the zones a policy chooses from."""

    name: str
    gap: float
    kind: str
    zones: list[ZoneTrace]
    folder: str = ""  # the trace folder's own name (aws-02-15-2023)

    @property
    def ticks(self) -> int:
        return len(self.zones[0].capacity)

    @property
    def duration(self) -> float:
        return self.ticks * self.gap

    @property
    def cloud(self) -> str:
        return self.zones[0].location.cloud

    @property
    def clouds(self) -> list[str]:
        """Every cloud the group's zones belong to (several for a merged group)."""
        return sorted({z.location.cloud for z in self.zones})

    @property
    def single_node(self) -> bool:
        """Every value is 0 or 1: the trace only probed whether one instance could be had."""
        return all(v <= 1 for z in self.zones for v in z.capacity)

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
    # Zones end in a letter right after the region (us-east-1a) or after a dash (us-east1-b).
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
    """A JSON object: zone, ZONE_KIND file stem or kind -> spot $/hour (most specific wins).
    Raises UserError when the file cannot be read or is not such an object."""
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


def load_groups(folder: str | Path, prices: dict[str, float] | None = None) -> list[TraceGroup]:
    """The trace groups of one folder: one per instance kind, each cut to the common prefix.
    Raises UserError naming the file or folder that is not a valid trace."""
    folder = Path(folder)
    files = sorted(folder.glob("*.json"))
    if not files:
        raise UserError(f"trace folder {folder}: no *.json trace files")
    prices = prices or {}
    by_kind: dict[str, list[tuple[str, Path]]] = {}
    for f in files:
        zone, kind = _split_stem(f)
        by_kind.setdefault(kind, []).append((zone, f))
    cloud = cloud_of_name(folder.name)
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
        groups.append(TraceGroup(name, gaps.pop(), kind, zones, folder.name))
    return groups


def merge_groups(groups: list[TraceGroup], name: str | None = None) -> TraceGroup:
    """Several trace groups as one market: every zone keeps its cloud, kind and prices, all on
    the finest sample length (each sample held until its next) and cut to the shortest span.
    Raises UserError for fewer than two groups or a zone named twice."""
    if len(groups) < 2:
        raise UserError("merging traces into one market needs at least two trace groups")
    locations = [z.location for g in groups for z in g.zones]
    if len(set(locations)) != len(locations):
        raise UserError("merging traces: a zone appears in two of them: " +
                        ", ".join(sorted({str(loc) for loc in locations if locations.count(loc) > 1})))
    gap = min(g.gap for g in groups)
    ticks = int(min(g.duration for g in groups) // gap)
    zones = []
    for g in groups:
        # Tick i of the merged grid lies in sample floor(i * gap / g.gap) of the group's own.
        index = [min(int(i * gap // g.gap), g.ticks - 1) for i in range(ticks)]
        for z in g.zones:
            zones.append(ZoneTrace(z.location, [z.capacity[j] for j in index], [z.spot_prices[j] for j in index],
                                   z.kind or g.kind))
    kinds = list(dict.fromkeys(z.kind for z in zones))
    return TraceGroup(name or "+".join(g.name for g in groups), gap, "+".join(kinds), zones,
                      "+".join(g.folder for g in groups))


def cloud_part(group: TraceGroup, cloud: str) -> TraceGroup:
    """The zones of one cloud of a (merged) group, on the same grid and span: the single-cloud
    market to compare a multi-cloud replay with. Raises UserError if the group has none."""
    zones = [z for z in group.zones if z.location.cloud == cloud]
    if not zones:
        raise UserError(f"trace group {group.name} has no zone of cloud {cloud!r}")
    kinds = list(dict.fromkeys(z.kind or group.kind for z in zones))
    return dataclasses.replace(group, name=f"{group.name}[{cloud}]", kind="+".join(kinds), zones=zones)


def expand_trace_dirs(paths: Iterable[str | Path]) -> list[tuple[Path, Path | None]]:
    """(trace folder, the folder it was found under) for each path: a trace folder itself
    (root None), or a folder whose sub-folders at any depth hold trace folders. Raises
    UserError for a path that is not a folder or holds no trace."""
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


def labelled_groups(
    trace_dirs: Iterable[str | Path], prices: dict[str, float] | None = None
) -> list[tuple[str, TraceGroup]]:
    """(label, group) for every trace group under `trace_dirs`, in folder order."""
    return [
        (group_label(g, folder, root), g)
        for folder, root in expand_trace_dirs(trace_dirs)
        for g in load_groups(folder, prices)
    ]


def one_market(
    trace_dirs: Iterable[str | Path], prices: dict[str, float] | None = None
) -> list[tuple[str, TraceGroup]]:
    """Every trace group under `trace_dirs` merged into one market, as [(label, group)]."""
    labelled = labelled_groups(trace_dirs, prices)
    label = " + ".join(label for label, _ in labelled)
    return [(label, merge_groups([g for _, g in labelled], label))]
