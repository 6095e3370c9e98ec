"""GPU catalog: which accelerator an instance type carries, and the SkyPilot v8 price CSVs.

Stdlib only and free of control-plane imports, so providers can use it without pulling in
the price book. The CSV loader prefers an up-to-date `~/.sky/catalogs/v8/<cloud>/vms.csv`
(what SkyPilot downloads) and falls back to the small snapshot shipped in providers/catalog/.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import re
import time
from pathlib import Path

from providers.base import Location, Market, Offer

CLOUDS = ("aws", "gcp", "azure")
SHIPPED_DIR = Path(__file__).resolve().parent / "v8"
# When the shipped snapshot's prices were taken (providers/catalog/README.md); its files'
# mtimes only say when the package was installed.
SHIPPED_SNAPSHOT_AT = 1796083200.0  # 2026-12-01T00:00:00Z
# A SkyPilot catalog older than this is not trusted over the shipped snapshot.
MAX_SKY_CATALOG_AGE_S = 7 * 24 * 3600
# GCP prices attachable GPUs alone; an offer needs the host VM they attach to.
GCP_GPU_HOST = "n1-standard-8"
GCP_GPU_HOST_FALLBACK = (0.38, 0.0735)  # (on-demand, spot) $/h of n1-standard-8 in us-central1


def _series(prefix: str, accelerator: str, counts: dict[str, int]) -> dict[str, tuple[str, int]]:
    return {f"{prefix}{suffix}": (accelerator, n) for suffix, n in counts.items()}


# Instance type -> (accelerator, count). The CSVs carry this for most rows, but GCP's
# accelerator-optimized families (a2, a3, g2) leave it empty and the live price APIs
# (spot price history, Retail Prices) never carry it.
GPU_TYPES: dict[str, dict[str, tuple[str, int]]] = {
    "aws": {
        **_series("g4dn.", "T4", {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1,
                                  "12xlarge": 4, "metal": 8}),
        **_series("g5.", "A10G", {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1,
                                  "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
        **_series("g6.", "L4", {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1,
                                "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
        **_series("g6e.", "L40S", {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1,
                                   "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}),
        **_series("p3.", "V100", {"2xlarge": 1, "8xlarge": 4, "16xlarge": 8}),
        "p3dn.24xlarge": ("V100-32GB", 8),
        "p4d.24xlarge": ("A100", 8),
        "p4de.24xlarge": ("A100-80GB", 8),
        "p5.48xlarge": ("H100", 8),
        "p5e.48xlarge": ("H200", 8),
        "p5en.48xlarge": ("H200", 8),
    },
    "gcp": {
        **_series("a2-highgpu-", "A100", {"1g": 1, "2g": 2, "4g": 4, "8g": 8}),
        "a2-megagpu-16g": ("A100", 16),
        **_series("a2-ultragpu-", "A100-80GB", {"1g": 1, "2g": 2, "4g": 4, "8g": 8}),
        **_series("a3-highgpu-", "H100", {"1g": 1, "2g": 2, "4g": 4, "8g": 8}),
        "a3-edgegpu-8g": ("H100", 8),
        "a3-megagpu-8g": ("H100-MEGA", 8),
        "a3-ultragpu-8g": ("H200", 8),
        **_series("g2-standard-", "L4", {"4": 1, "8": 1, "12": 1, "16": 1, "32": 1, "24": 2, "48": 4, "96": 8}),
    },
    "azure": {
        **_series("Standard_NC", "T4", {"4as_T4_v3": 1, "8as_T4_v3": 1, "16as_T4_v3": 1, "64as_T4_v3": 4}),
        **_series("Standard_NC", "V100", {"6s_v3": 1, "12s_v3": 2, "24s_v3": 4, "24rs_v3": 4}),
        **_series("Standard_NC", "A100-80GB", {"24ads_A100_v4": 1, "48ads_A100_v4": 2, "96ads_A100_v4": 4}),
        "Standard_ND96asr_v4": ("A100", 8),
        "Standard_ND96amsr_A100_v4": ("A100-80GB", 8),
        **_series("Standard_NC", "H100", {"40ads_H100_v5": 1, "80adis_H100_v5": 2}),
        "Standard_ND96isr_H100_v5": ("H100", 8),
        "Standard_NV36ads_A10_v5": ("A10", 1),
    },
}

# GCP GPUs attached to n1 hosts: catalog name -> Compute Engine accelerator type.
GCP_ATTACHABLE = {"T4": "nvidia-tesla-t4", "V100": "nvidia-tesla-v100", "P100": "nvidia-tesla-p100",
                  "P4": "nvidia-tesla-p4"}


def accelerator_for(cloud: str, instance_type: str) -> tuple[str, int] | None:
    """The (accelerator, count) an instance type carries, or None for a CPU-only type."""
    known = GPU_TYPES.get(cloud, {}).get(instance_type)
    if known:
        return known
    if cloud == "gcp":  # "n1-standard-8+T4x2": an n1 host with attached GPUs (how offers name them)
        match = re.fullmatch(r"n1-[a-z]+-\d+\+([A-Za-z0-9-]+)x(\d+)", instance_type)
        if match:
            return match.group(1), int(match.group(2))
    return None


def gpu_instance_types(cloud: str, accelerator: str | None = None, count: int | None = None) -> list[str]:
    """The GPU instance types of a cloud, optionally only those with that accelerator (and count)."""
    return sorted(t for t, gpu in GPU_TYPES.get(cloud, {}).items() if gpu_matches(gpu, accelerator, count))


def gpu_matches(gpu: tuple[str, int] | None, accelerator: str | None, count: int | None = None) -> bool:
    if gpu is None:
        return False
    return (accelerator is None or gpu[0].lower() == accelerator.lower()) and (count is None or gpu[1] == count)


@dataclasses.dataclass(frozen=True)
class CatalogRow:
    cloud: str
    instance_type: str
    accelerator: str
    accelerator_count: int
    region: str
    zone: str
    price: float
    spot_price: float | None
    # GCP attachable GPUs: the n1 host's share of price/spot_price (the rest is the GPUs').
    host_price: float | None = None
    host_spot_price: float | None = None

    def offers(self, observed_at: float) -> list[Offer]:
        location = Location(self.cloud, self.region, self.zone)
        out = [Offer(location, self.instance_type, self.accelerator, self.accelerator_count,
                     Market.ON_DEMAND, self.price, observed_at)]
        if self.spot_price is not None:
            out.append(Offer(location, self.instance_type, self.accelerator, self.accelerator_count,
                             Market.SPOT, self.spot_price, observed_at))
        return out


@dataclasses.dataclass(frozen=True)
class Catalog:
    rows: list[CatalogRow]
    source: str  # the file read
    observed_at: float  # when its prices were taken: the snapshot's date, or a SkyPilot file's mtime

    def offers(self) -> list[Offer]:
        return [offer for row in self.rows for offer in row.offers(self.observed_at)]

    def on_demand_price(self, instance_type: str, region: str) -> float | None:
        """The regional on-demand price (AWS and Azure price on-demand per region, not zone)."""
        return self._regional().get((instance_type, region))

    def _regional(self) -> dict[tuple[str, str], float]:
        cached = self.__dict__.get("_regional_cache")
        if cached is None:
            cached = {(r.instance_type, r.region): r.price for r in self.rows}
            object.__setattr__(self, "_regional_cache", cached)
        return cached


def sky_catalog_path(cloud: str) -> Path:
    return Path(os.path.expanduser("~")) / ".sky" / "catalogs" / "v8" / cloud / "vms.csv"


def catalog_path(cloud: str, *, max_age_s: float = MAX_SKY_CATALOG_AGE_S, now: float | None = None) -> Path:
    """SkyPilot's downloaded catalog when present and fresh, else the shipped snapshot."""
    sky = sky_catalog_path(cloud)
    now = time.time() if now is None else now
    try:
        if now - sky.stat().st_mtime <= max_age_s:
            return sky
    except OSError:
        pass
    return SHIPPED_DIR / cloud / "vms.csv"


def load_catalog(cloud: str, path: Path | None = None) -> Catalog:
    """GPU rows of one cloud's v8 CSV (other rows, TPUs and unpriced rows are dropped)."""
    if cloud not in CLOUDS:
        raise ValueError(f"cloud {cloud!r}: expected one of {', '.join(CLOUDS)}")
    path = path or catalog_path(cloud)
    with path.open(newline="") as fh:
        records = list(csv.DictReader(fh))
    rows = _gcp_rows(records) if cloud == "gcp" else [r for rec in records if (r := _row(cloud, rec))]
    shipped = path.resolve().is_relative_to(SHIPPED_DIR)
    return Catalog(rows=rows, source=str(path), observed_at=SHIPPED_SNAPSHOT_AT if shipped else path.stat().st_mtime)


def _price(text: str | None) -> float | None:
    try:
        value = float(text) if text not in (None, "") else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


def _row(cloud: str, rec: dict[str, str], instance_type: str | None = None, **extra) -> CatalogRow | None:
    instance_type = instance_type or rec.get("InstanceType") or ""
    gpu = accelerator_for(cloud, instance_type)
    name = rec.get("AcceleratorName") or (gpu[0] if gpu else "")
    count = int(float(rec.get("AcceleratorCount") or (gpu[1] if gpu else 0)))
    price = _price(rec.get("Price"))
    if not name or count <= 0 or price is None or name.lower().startswith("tpu"):
        return None
    region = rec.get("Region") or ""
    zone = rec.get("AvailabilityZone") or region  # Azure's v8 file has no zone column
    return CatalogRow(cloud, instance_type, name, count, region, zone, price, _price(rec.get("SpotPrice")), **extra)


def _gcp_rows(records: list[dict[str, str]]) -> list[CatalogRow]:
    # Attachable GPUs (empty InstanceType) become "n1-standard-8+T4x1" offers priced as
    # host + GPUs, so they compare with the accelerator-optimized types on the whole machine.
    hosts = {(r["AvailabilityZone"], r["InstanceType"]): (_price(r.get("Price")), _price(r.get("SpotPrice")))
             for r in records if r.get("InstanceType") == GCP_GPU_HOST}
    rows = []
    for rec in records:
        if rec.get("InstanceType"):
            row = _row("gcp", rec)
        elif rec.get("AcceleratorName") in GCP_ATTACHABLE:
            host_od, host_spot = hosts.get((rec.get("AvailabilityZone", ""), GCP_GPU_HOST), GCP_GPU_HOST_FALLBACK)
            count = int(float(rec.get("AcceleratorCount") or 0))
            name = f"{GCP_GPU_HOST}+{rec['AcceleratorName']}x{count}"
            gpu_od, gpu_spot = _price(rec.get("Price")), _price(rec.get("SpotPrice"))
            priced = dict(rec, Price=str(round(gpu_od + (host_od or 0), 6)) if gpu_od else "",
                          SpotPrice=str(round(gpu_spot + (host_spot or 0), 6)) if gpu_spot else "")
            row = _row("gcp", priced, instance_type=name, host_price=host_od, host_spot_price=host_spot)
        else:
            row = None
        if row:
            rows.append(row)
    return rows


def snapshot_offers(cloud: str, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
    """The cloud's offers from its price file (no network), marked with that source."""
    return [dataclasses.replace(o, source="snapshot") for o in load_catalog(cloud).offers()
            if gpu_matches((o.accelerator, o.accelerator_count), accelerator, count)]


def load_all(clouds: tuple[str, ...] | list[str] = CLOUDS) -> dict[str, Catalog]:
    return {cloud: load_catalog(cloud) for cloud in clouds}
