"""What the shard traffic of one connector costs when it leaves a cloud or a region.

The connector's settings carry the daemon's egress table ({cloud: {"out_of_cloud", "inter_region"}}
in USD per GB, from the provider layer); `EgressPrices` reads it without knowing any cloud, and
`EgressMeter` counts the bytes each store call moved between this replica's store and another
one, priced at the sending cloud's rate, by destination cloud. The pool calls `count`; the stats
endpoint serves `snapshot`. Bytes inside one region of one cloud are not egress and not counted.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.common.errors import UserError
from orchestrator.replica.kv.placement import StoreNode

GB = 1e9
_RATES = ("out_of_cloud", "inter_region")


@dataclass(frozen=True)
class EgressPrices:
    """USD per GB sent, per source cloud; a cloud missing from the table costs nothing."""

    rates: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: object, name: str = "kv_connector_extra_config.egress") -> EgressPrices:
        """From the JSON table; UserError naming the first bad entry."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise UserError(f"{name}: expected {{cloud: {{out_of_cloud, inter_region}}}} in USD per GB")
        rates = {}
        for cloud, entry in raw.items():
            if not isinstance(entry, Mapping) or set(entry) - set(_RATES):
                raise UserError(f"{name}.{cloud}: expected an object with {', '.join(_RATES)}")
            values = {rate: entry.get(rate, 0.0) for rate in _RATES}
            for rate, value in values.items():
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise UserError(f"{name}.{cloud}.{rate}: expected a price >= 0, got {value!r}")
            rates[str(cloud)] = {rate: float(value) for rate, value in values.items()}
        return cls(rates)

    def per_gb(self, source: StoreNode, destination: StoreNode) -> float | None:
        """The price of a GB sent from `source` to `destination`; None when it stays in one
        region of one cloud (not egress)."""
        if source.cloud != destination.cloud:
            rate = "out_of_cloud"
        elif source.region != destination.region:
            rate = "inter_region"
        else:
            return None
        return self.rates.get(source.cloud, {}).get(rate, 0.0)


class EgressMeter:
    """Bytes and USD of the traffic between `home` (this replica's store) and the others, by
    destination cloud. Thread-safe."""

    def __init__(self, prices: EgressPrices, home: StoreNode | None):
        self.prices, self.home = prices, home
        self._lock = threading.Lock()
        self._by_cloud: dict[str, dict[str, float]] = {}

    def count(self, peer: StoreNode, sent: int, received: int) -> None:
        """One store call: `sent` bytes from home to `peer`, `received` bytes back."""
        if self.home is None:
            return
        for source, destination, nbytes in ((self.home, peer, sent), (peer, self.home, received)):
            price = self.prices.per_gb(source, destination) if nbytes else None
            if price is None:
                continue
            with self._lock:
                entry = self._by_cloud.setdefault(destination.cloud, {"bytes": 0, "usd": 0.0})
                entry["bytes"] += nbytes
                entry["usd"] += nbytes / GB * price

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {cloud: dict(entry) for cloud, entry in sorted(self._by_cloud.items())}
