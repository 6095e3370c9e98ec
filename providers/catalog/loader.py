"""GPU prices from SkyPilot's catalogs (`sky.catalog`), seeded from the snapshot shipped beside this file.

SkyPilot maintains the price catalogs; this module only decides where sky reads them and never lets
sky download on its own: a project-owned directory (SPOT_ORCHESTRATOR_SKY_DIR, default
$SPOT_ORCHESTRATOR_HOME/sky) becomes sky's SKY_RUNTIME_DIR, is seeded from `v8/<cloud>/vms.csv` when
a cloud has no file, and `refresh()` (`spotctl prices --refresh`) replaces a file with the hosted
catalog, bounded by a timeout and atomically. `catalog_offers()` turns sky's answers into per-zone
Offers (GCP: host VM plus its GPUs) tagged "catalog" or "snapshot" with the time their prices were
taken. The providers (aws, gcp, azure) and the price book call it; sky is imported on first use only
(it costs seconds). Reasoning and sky's quirks: docs/prices.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from providers.base import Location, Market, Offer

log = logging.getLogger(__name__)

CLOUDS = ("aws", "gcp", "azure")
SHIPPED_DIR = Path(__file__).resolve().parent / "v8"
# When the shipped snapshot's prices were taken (providers/catalog/README.md); its files'
# mtimes only say when the package was installed.
SHIPPED_SNAPSHOT_AT = 1796169600.0  # 2026-12-02T00:00:00Z
SOURCE_SNAPSHOT = "snapshot"  # the file shipped with spot-orchestrator
SOURCE_CATALOG = "catalog"  # a file SkyPilot's hosted catalog served (refresh), or one put there by hand
SOURCE_LIVE = "live"  # the cloud's own price API
CATALOG_URL_ENV = "SPOT_ORCHESTRATOR_CATALOG_URL"  # a mirror of SkyPilot's hosted catalogs
SKY_DIR_ENV = "SPOT_ORCHESTRATOR_SKY_DIR"
REFRESH_TIMEOUT_S = 20.0
_PROVENANCE = "spot-orchestrator-sources.json"  # beside the cloud folders: where each file came from

# GCP GPUs attached to n1 hosts: catalog name -> Compute Engine accelerator type.
GCP_ATTACHABLE = {"T4": "nvidia-tesla-t4", "V100": "nvidia-tesla-v100", "P100": "nvidia-tesla-p100",
                  "P4": "nvidia-tesla-p4"}
_ATTACHED = re.compile(r"(n1-[a-z]+-\d+)\+([A-Za-z0-9-]+)x(\d+)")  # "n1-highmem-4+T4x1"

_lock = threading.RLock()


class CatalogError(Exception):
    """A catalog could not be read or refreshed; the message is one line fit for a user."""


def sky_runtime_dir() -> Path:
    """The SKY_RUNTIME_DIR spot-orchestrator gives sky (sky adds .sky/catalogs/v8/<cloud>/vms.csv)."""
    explicit = os.environ.get(SKY_DIR_ENV)
    if explicit:
        return Path(explicit)
    from orchestrator.common.paths import home

    return home() / "sky"


@functools.lru_cache(maxsize=1)
def _sky():
    """sky.catalog, imported once with SKY_RUNTIME_DIR pointing at our directory (sky fixes the
    catalog path at import) and the environment restored afterwards, so child processes and a
    SkyPilot the user runs are unaffected."""
    runtime = sky_runtime_dir()
    runtime.mkdir(parents=True, exist_ok=True)
    before = os.environ.get("SKY_RUNTIME_DIR")
    os.environ["SKY_RUNTIME_DIR"] = str(runtime)
    try:
        from sky.utils import annotations

        annotations.is_on_api_server = False  # else sky's spinners print payload lines to stdout
        import sky.catalog as catalog
        from sky.catalog import common
    finally:
        if before is None:
            os.environ.pop("SKY_RUNTIME_DIR", None)
        else:
            os.environ["SKY_RUNTIME_DIR"] = before
    for name in ("sky", "filelock"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return catalog, common


def catalog_dir() -> Path:
    """Where sky reads `<cloud>/vms.csv` in this process."""
    _, common = _sky()
    return Path(common.get_catalog_path("aws/vms.csv")).parent.parent


# ---- provenance: which file each cloud has, and when its prices were taken ----------------------


@dataclasses.dataclass(frozen=True)
class Provenance:
    source: str  # SOURCE_SNAPSHOT or SOURCE_CATALOG
    observed_at: float
    origin: str = ""  # the URL a refresh fetched, or the shipped file


def _read_provenance(root: Path) -> dict[str, dict]:
    try:
        return json.loads((root / _PROVENANCE).read_text())
    except (OSError, ValueError):
        return {}


def _write_provenance(root: Path, cloud: str, prov: Provenance) -> None:
    data = _read_provenance(root)
    data[cloud] = dataclasses.asdict(prov)
    _atomic_write(root / _PROVENANCE, json.dumps(data, indent=1).encode())


def provenance(cloud: str, root: Path | None = None) -> Provenance:
    """Where `cloud`'s catalog file came from; a file we did not write counts as a catalog of its mtime."""
    root = root or catalog_dir()
    entry = _read_provenance(root).get(cloud)
    path = root / cloud / "vms.csv"
    if entry:
        return Provenance(**entry)
    try:
        return Provenance(SOURCE_CATALOG, path.stat().st_mtime, str(path))
    except OSError:
        return Provenance(SOURCE_SNAPSHOT, SHIPPED_SNAPSHOT_AT, str(SHIPPED_DIR / cloud / "vms.csv"))


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def seed(root: Path | None = None, clouds: tuple[str, ...] | list[str] = CLOUDS) -> list[str]:
    """Copy the shipped snapshot into sky's catalog directory for every cloud that has no file (or
    only an older seeded snapshot). No .md5 is written, so sky treats the file as put there by hand
    and never downloads over it. Returns the clouds seeded."""
    root = root or catalog_dir()
    seeded = []
    with _lock:
        known = _read_provenance(root)
        for cloud in clouds:
            target = root / cloud / "vms.csv"
            entry = known.get(cloud, {})
            stale_seed = entry.get("source") == SOURCE_SNAPSHOT and entry.get("observed_at", 0) < SHIPPED_SNAPSHOT_AT
            if target.exists() and not stale_seed:
                continue
            shipped = SHIPPED_DIR / cloud / "vms.csv"
            _atomic_write(target, shipped.read_bytes())
            _write_provenance(root, cloud, Provenance(SOURCE_SNAPSHOT, SHIPPED_SNAPSHOT_AT, str(shipped)))
            seeded.append(cloud)
    return seeded


def hosted_catalog_urls(cloud: str) -> list[str]:
    """The hosted v8 catalog of a cloud: $SPOT_ORCHESTRATOR_CATALOG_URL, else SkyPilot's URL and its mirror."""
    mirror = os.environ.get(CATALOG_URL_ENV)
    if mirror:
        return [f"{mirror.rstrip('/')}/v8/{cloud}/vms.csv"]
    from sky.skylet import constants

    return [f"{base}/{constants.CATALOG_SCHEMA_VERSION}/{cloud}/vms.csv"
            for base in (constants.HOSTED_CATALOG_DIR_URL, constants.HOSTED_CATALOG_DIR_URL_S3_MIRROR)]


def refresh(clouds: tuple[str, ...] | list[str] = CLOUDS, *, root: Path | None = None,
            timeout_s: float = REFRESH_TIMEOUT_S, now: float | None = None) -> dict[str, str | None]:
    """Download each cloud's hosted catalog (bounded by `timeout_s` per request) and replace the file
    atomically. Returns {cloud: None on success, else a one-line reason}; a failed cloud keeps its
    file. Run it before the first price query of a process: sky caches what it has read."""
    import httpx

    root = root or catalog_dir()
    results: dict[str, str | None] = {}
    for cloud in clouds:
        error = "no URL"
        for url in hosted_catalog_urls(cloud):
            try:
                reply = httpx.get(url, timeout=timeout_s, headers={"User-Agent": "SkyPilot/0.7"}, follow_redirects=True)
            except httpx.HTTPError as err:
                error = f"{type(err).__name__} ({url})"
                continue
            if reply.status_code != 200:
                error = f"HTTP {reply.status_code} ({url})"
                continue
            header = reply.text.split("\n", 1)[0]
            if "InstanceType" not in header or "Price" not in header:
                error = f"not a SkyPilot catalog ({url})"
                continue
            with _lock:
                _atomic_write(root / cloud / "vms.csv", reply.content)
                _write_provenance(root, cloud, Provenance(SOURCE_CATALOG, time.time() if now is None else now, url))
            error = None
            break
        results[cloud] = error
    _cached_offers.cache_clear()
    return results


# ---- offers ---------------------------------------------------------------------------------------


def _ready(cloud: str):
    if cloud not in CLOUDS:
        raise ValueError(f"cloud {cloud!r}: expected one of {', '.join(CLOUDS)}")
    catalog, _ = _sky()
    root = catalog_dir()
    seed(root, [cloud])
    if cloud == "aws":
        _skip_aws_identity()
    return catalog, root


@functools.lru_cache(maxsize=1)
def _skip_aws_identity() -> None:
    """sky's first AWS query runs `aws configure list` and STS to map AZ ids to this account's AZ
    names; prices need neither (offers keep AZ ids, as the catalog has them). sky 0.14 keeps the
    mapped frame in aws_catalog._user_df: fill it with the unmapped one."""
    from sky.catalog import aws_catalog

    if getattr(aws_catalog, "_user_df", "missing") is None and hasattr(aws_catalog, "_default_df"):
        aws_catalog._user_df = aws_catalog._default_df._load_df()


def _num(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def instance_name(cloud: str, host: str, accelerator: str, count: int) -> str:
    """An offer's instance type: GCP's n1 hosts with attached GPUs are named "n1-highmem-4+T4x1"."""
    if cloud == "gcp" and host.startswith("n1-"):
        return f"{host}+{accelerator}x{count}"
    return host


def parse_attached(instance_type: str) -> tuple[str, str, int] | None:
    """"n1-highmem-4+T4x1" -> ("n1-highmem-4", "T4", 1); None for any other name."""
    match = _ATTACHED.fullmatch(instance_type)
    return (match.group(1), match.group(2), int(match.group(3))) if match else None


@dataclasses.dataclass(frozen=True)
class Machine:
    """One instance type in one region, as the catalog prices it (what live prices reprice)."""

    cloud: str
    instance_type: str  # the offer's name (GCP attached GPUs: "n1-highmem-4+T4x1")
    host: str  # the VM type sky prices (the n1 host for attached GPUs)
    accelerator: str
    count: int
    vcpus: float | None
    memory_gib: float | None
    region: str
    on_demand: float
    zones: tuple[str, ...]


def machines(cloud: str, accelerator: str | None = None, count: int | None = None) -> list[Machine]:
    """The GPU instance types of a cloud per region, from sky's list_accelerators (GCP: host + GPUs)."""
    return list(_machines(cloud, accelerator.lower() if accelerator else None, count))


@functools.lru_cache(maxsize=64)
def _machines(cloud: str, accelerator: str | None, count: int | None) -> tuple[Machine, ...]:
    catalog, _ = _ready(cloud)
    name_filter = f"^{re.escape(accelerator)}$" if accelerator else None
    try:
        found = catalog.list_accelerators(gpus_only=True, name_filter=name_filter, quantity_filter=count,
                                          clouds=cloud, case_sensitive=False, all_regions=True)
    except Exception as err:  # a broken or foreign CSV: say which file
        raise CatalogError(f"{cloud} price catalog {catalog_dir() / cloud / 'vms.csv'} unreadable: {err}") from err
    out = []
    for accel, infos in found.items():
        for info in infos:
            od, n = _num(info.price), int(info.accelerator_count)
            if od is None or not info.instance_type or n < 1:
                continue
            zones = _zones(catalog, cloud, info.instance_type, accel, n, info.region)
            out.append(Machine(cloud, instance_name(cloud, info.instance_type, accel, n), info.instance_type, accel, n,
                               _num(info.cpu_count), _num(info.memory), info.region, od, zones))
    return tuple(sorted(out, key=lambda m: (m.accelerator, m.count, m.instance_type, m.region)))


def _zones(catalog, cloud: str, host: str, accelerator: str, count: int, region: str) -> tuple[str, ...]:
    if cloud == "azure":
        return (region,)  # Azure prices regions; the catalog has no zones
    regions = catalog.get_region_zones_for_instance_type(host, False, clouds=cloud)
    zones = {z.name for r in regions if r.name == region for z in (r.zones or [])}
    if cloud == "gcp":  # the GPU must be offered in the host's zone too
        gpu_regions = catalog.get_region_zones_for_accelerators(accelerator, count, False, clouds=cloud)
        zones &= {z.name for r in gpu_regions if r.name == region for z in (r.zones or [])}
    return tuple(sorted(zones))


def host_price(cloud: str, host: str, region: str, zone: str, market: Market) -> float | None:
    """The catalog's hourly price of a VM type in a zone (GCP: the host alone, without GPUs)."""
    catalog, _ = _ready(cloud)
    try:
        return _num(catalog.get_hourly_cost(host, market is Market.SPOT, region, None if cloud == "azure" else zone,
                                            clouds=cloud))
    except (ValueError, KeyError, AssertionError):
        return None


def _spot(catalog, machine: Machine, zone: str) -> float | None:
    """The zone's spot price (GCP: host plus GPUs); None where the catalog has none."""
    price = host_price(machine.cloud, machine.host, machine.region, zone, Market.SPOT)
    if price is None or machine.cloud != "gcp":
        return price
    try:
        gpus = catalog.get_accelerator_hourly_cost(machine.accelerator, machine.count, True, machine.region, zone,
                                                   clouds="gcp")
    except (ValueError, KeyError, AssertionError):
        return None
    return None if _num(gpus) is None else price + gpus


def catalog_offers(cloud: str, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
    """Per-zone offers of both markets from the catalog file sky reads. Spot quotes at or above the
    on-demand price (no spot market there) are left out."""
    return list(_cached_offers(cloud, accelerator.lower() if accelerator else None, count))


@functools.lru_cache(maxsize=64)
def _cached_offers(cloud: str, accelerator: str | None, count: int | None) -> tuple[Offer, ...]:
    catalog, root = _ready(cloud)
    prov = provenance(cloud, root)
    out = []
    for machine in _machines(cloud, accelerator, count):
        for zone in machine.zones:
            location = Location(cloud, machine.region, zone)
            out.append(Offer(location, machine.instance_type, machine.accelerator, machine.count, Market.ON_DEMAND,
                             machine.on_demand, prov.observed_at, prov.source))
            spot = _spot(catalog, machine, zone)
            if spot is not None and spot < machine.on_demand:
                out.append(Offer(location, machine.instance_type, machine.accelerator, machine.count, Market.SPOT,
                                 spot, prov.observed_at, prov.source))
    return tuple(out)


def catalog_regions(cloud: str) -> list[str]:
    """The regions with GPU offers in a cloud's catalog."""
    return sorted({m.region for m in machines(cloud)})


def accelerator_for(cloud: str, instance_type: str) -> tuple[str, int] | None:
    """The (accelerator, count) an instance type carries per the catalog; None for a CPU-only type."""
    attached = parse_attached(instance_type) if cloud == "gcp" else None
    if attached:
        return attached[1], attached[2]
    return _accelerator_index(cloud).get(instance_type)


@functools.lru_cache(maxsize=8)
def _accelerator_index(cloud: str) -> dict[str, tuple[str, int]]:
    return {m.instance_type: (m.accelerator, m.count) for m in machines(cloud)}


def gpu_instance_types(cloud: str, accelerator: str | None = None, count: int | None = None) -> list[str]:
    """The GPU instance types of a cloud's catalog, optionally only those with that accelerator (and count)."""
    return sorted({m.instance_type for m in machines(cloud, accelerator, count)})
