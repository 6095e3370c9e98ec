"""Target replica count from request rate, with SkyServe's hysteresis. Pure: values in, values out.

SkyServe: target = ceil(QPS over the last window / target_qps_per_replica), clipped to
[min, max]; a change is applied only after it has been wanted for upscale_delay (resp.
downscale_delay) seconds, so a burst does not flap the fleet. Each service's controller
(orchestrator.control.controller) keeps one and asks it for the target on every reconcile.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque


@dataclasses.dataclass
class AutoscalerConfig:
    min_replicas: int
    max_replicas: int
    target_qps_per_replica: float | None = None
    upscale_delay_s: float = 300.0
    downscale_delay_s: float = 1200.0
    window_s: float = 60.0


class RequestRateAutoscaler:
    """Feed it request timestamps; ask it for the target at any time."""

    def __init__(self, config: AutoscalerConfig, now: float):
        self.config = config
        self._arrivals: deque[float] = deque()
        self._target = config.min_replicas
        self._wanted: int | None = None
        self._wanted_since = now

    def record_requests(self, timestamps: list[float]) -> None:
        self._arrivals.extend(sorted(timestamps))

    def qps(self, now: float) -> float:
        horizon = now - self.config.window_s
        while self._arrivals and self._arrivals[0] < horizon:
            self._arrivals.popleft()
        return len(self._arrivals) / self.config.window_s

    def raw_target(self, now: float) -> int:
        cfg = self.config
        if not cfg.target_qps_per_replica:
            return cfg.min_replicas
        wanted = math.ceil(self.qps(now) / cfg.target_qps_per_replica)
        return max(cfg.min_replicas, min(cfg.max_replicas, wanted))

    def target(self, now: float) -> int:
        wanted = self.raw_target(now)
        if wanted == self._target:
            self._wanted = None
            return self._target
        if wanted != self._wanted:
            self._wanted, self._wanted_since = wanted, now
        delay = self.config.upscale_delay_s if wanted > self._target else self.config.downscale_delay_s
        if now - self._wanted_since >= delay:
            self._target, self._wanted = wanted, None
        return self._target
