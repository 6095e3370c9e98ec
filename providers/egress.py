"""What traffic leaving a cloud costs, per cloud: the one table of egress prices.

The daemon's launcher hands `egress_table()` to each replica's KV connector (in its extra
config), which prices the shard bytes it moves across clouds and regions with it; the replica
side never imports this module, so it never names a cloud. Figures are the first paid tier,
North American regions, in USD per GB; docs/kv-cache.md lists the sources and the date read.
"""

from __future__ import annotations

from typing import NamedTuple

PRICES_READ = "2026-12-02"  # when the figures below were last read from the sources in docs/kv-cache.md


class EgressPrice(NamedTuple):
    out_of_cloud: float  # USD/GB sent from this cloud to another cloud (the internet rate)
    inter_region: float  # USD/GB sent between two regions of this cloud


EGRESS_USD_PER_GB: dict[str, EgressPrice] = {
    "aws": EgressPrice(out_of_cloud=0.09, inter_region=0.02),
    "gcp": EgressPrice(out_of_cloud=0.12, inter_region=0.02),
    "azure": EgressPrice(out_of_cloud=0.087, inter_region=0.02),
    "local": EgressPrice(out_of_cloud=0.0, inter_region=0.0),  # processes of one host
}


def egress_table() -> dict[str, dict[str, float]]:
    """The table as JSON-ready data: {cloud: {"out_of_cloud": usd_per_gb, "inter_region": usd_per_gb}}."""
    return {cloud: price._asdict() for cloud, price in EGRESS_USD_PER_GB.items()}
