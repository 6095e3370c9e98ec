"""The service spec as frozen dataclasses, and its serialization back to a plain mapping.

`ServiceSpec` is what every plane reads: the controller (replica counts, probe, policy
knobs), the launcher (engine, resources, kv) and the API (status). It is built only by
`orchestrator.spec.parse`; `to_dict()` / `to_json()` give the normalized mapping the store
keeps, and `parse_spec(spec.to_dict()) == spec`.

`candidate_locations(known)` filters the locations the clouds offer (`known`, from the
providers) by the spec's cloud/region/zone patterns and any_of alternatives.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from policies.base import ServiceParams
from providers.base import Location

LB_POLICIES = ("round_robin", "least_load", "instance_aware_least_load")  # SkyServe's names
DEFAULT_LB_POLICY = "least_load"
SPOT_PLACERS = ("dynamic_fallback",)
DEFAULT_PLACEMENT_POLICY = "default"  # policies.base.load_policy resolves it
CPU_BLOCK_SIZE = 32  # vLLM's CPU attention needs a block size that is a multiple of 32
TINY_MODEL = "tiny"  # the locally generated demo model (orchestrator.replica.demo_model)


@dataclasses.dataclass(frozen=True)
class ReadinessProbe:
    path: str = "/health"
    initial_delay_seconds: float = 1200.0
    timeout_seconds: float = 15.0
    post_data: str | Mapping[str, Any] | None = None
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # SkyServe's optional knobs; None = the controller's defaults (10 s, 180 s).
    endpoint_probe_interval_seconds: float | None = None
    consecutive_failure_threshold_timeout: float | None = None


@dataclasses.dataclass(frozen=True)
class ReplicaPolicy:
    min_replicas: int
    max_replicas: int | None = None  # None: fixed at min_replicas (no autoscaling)
    target_qps_per_replica: float | Mapping[str, float] | None = None
    num_overprovision: int = 0
    base_ondemand_fallback_replicas: int = 0
    dynamic_ondemand_fallback: bool = False
    spot_placer: str | None = None
    upscale_delay_seconds: float = 300.0
    downscale_delay_seconds: float = 1200.0


@dataclasses.dataclass(frozen=True)
class TLS:
    keyfile: str
    certfile: str


@dataclasses.dataclass(frozen=True)
class ServiceSection:
    readiness_probe: ReadinessProbe = ReadinessProbe()
    replica_policy: ReplicaPolicy = ReplicaPolicy(min_replicas=1)
    replicas: int | None = None  # as written (`replicas: N` means min = max = N)
    load_balancing_policy: str = DEFAULT_LB_POLICY
    ports: int | None = None  # the load balancer's port; None = pick a free one
    tls: TLS | None = None
    placement_policy: str = DEFAULT_PLACEMENT_POLICY
    # SkyServe keys accepted and kept but not acted on (load_balancer, pool, workers).
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, order=True)
class Accelerator:
    name: str
    count: int = 1

    def __str__(self) -> str:
        return f"{self.name}:{self.count}"


@dataclasses.dataclass(frozen=True)
class Resources:
    """SkyPilot's resources: what we act on is typed; the rest is kept in `extra`."""

    cloud: str | None = None
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    accelerators: tuple[Accelerator, ...] = ()  # alternatives; the first is preferred
    use_spot: bool | None = None  # None = not set (SkyPilot's default: on-demand)
    ports: tuple[str, ...] = ()
    any_of: tuple[Resources, ...] = ()
    ordered: bool = False  # written as `ordered:` (alternatives tried in order), not `any_of:`
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def accelerator(self) -> Accelerator | None:
        return self.accelerators[0] if self.accelerators else None


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    model: str  # a HF repo id, a local directory, or "tiny" (the demo model)
    args: tuple[str, ...] = ()  # extra vLLM CLI arguments, appended verbatim
    max_model_len: int | None = None
    block_size: int | None = None  # None: 32 on CPU, vLLM's default on GPU
    dtype: str | None = None

    @property
    def is_tiny(self) -> bool:
        return self.model == TINY_MODEL

    def block_size_for(self, on_cpu: bool) -> int | None:
        return self.block_size if self.block_size is not None else (CPU_BLOCK_SIZE if on_cpu else None)


KV_FAILURE_DOMAINS = ("zone", "region", "cloud")  # narrowest first: the replica's placement has the same


@dataclasses.dataclass(frozen=True)
class KVSpec:
    enabled: bool = True
    k: int = 4
    m: int = 2
    # Losing one whole such domain loses at most m shards of a block; shards leave a cloud only for "cloud".
    failure_domain: str = "zone"
    store_max_bytes: int = 1 << 30
    ttl_seconds: float = 3600.0


@dataclasses.dataclass(frozen=True)
class ServiceSpec:
    name: str
    engine: EngineSpec
    service: ServiceSection = ServiceSection()
    resources: Resources = Resources()
    kv: KVSpec = KVSpec()
    # SkyPilot task keys (setup, run, envs, workdir, num_nodes, file_mounts, ...): kept.
    task: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def min_replicas(self) -> int:
        return self.service.replica_policy.min_replicas

    @property
    def max_replicas(self) -> int:
        policy = self.service.replica_policy
        return policy.max_replicas if policy.max_replicas is not None else policy.min_replicas

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas > self.min_replicas

    @property
    def use_spot(self) -> bool:
        """Spot wanted anywhere: top-level `use_spot`, or any any_of alternative's."""
        return bool(self.resources.use_spot) or any(alt.use_spot for alt in self.resources.any_of)

    @property
    def accelerator(self) -> Accelerator | None:
        alts = [self.resources.accelerator, *(alt.accelerator for alt in self.resources.any_of)]
        return next((a for a in alts if a is not None), None)

    def accelerators_wanted(self) -> list[tuple[str, int]]:
        """Every (accelerator, count) the spec accepts (top level and any_of), in preference
        order; [] = any machine."""
        alts = [*self.resources.accelerators, *(a for alt in self.resources.any_of for a in alt.accelerators)]
        return list(dict.fromkeys((a.name, a.count) for a in alts))

    @property
    def image_id(self) -> str | None:
        """SkyPilot's `resources.image_id` (a string, or {region: image}); None: the cloud's default."""
        return self.resources.extra.get("image_id")

    def _location_filters(self) -> list[tuple[str | None, str | None, str | None]]:
        """(cloud, region, zone) patterns, None = any; any_of entries inherit the top level."""
        top = self.resources
        alts = self.resources.any_of or (top,)
        return [(a.cloud or top.cloud, a.region or top.region, a.zone or top.zone) for a in alts]

    def regions(self, cloud: str | None = None) -> list[str]:
        """The regions the spec names (on `cloud`, when given), when every such alternative
        names one; [] = not limited."""
        filters = [f for f in self._location_filters() if cloud is None or f[0] in (None, cloud)]
        if not filters or any(region is None for _, region, _ in filters):
            return []
        return list(dict.fromkeys(region for _, region, _ in filters))

    def clouds(self) -> list[str]:
        """The clouds the spec names (top level and any_of), in preference order; [] = any."""
        return list(dict.fromkeys(cloud for cloud, _, _ in self._location_filters() if cloud))

    def candidate_locations(self, known: Iterable[Location] = ()) -> list[Location]:
        """Where the service may run, in preference order, without duplicates: the `known`
        locations (what the providers offer) that match the spec's cloud/region/zone patterns,
        plus every fully named location (cloud, region and zone), known or not."""
        known = list(known)
        out: list[Location] = []
        for cloud, region, zone in self._location_filters():
            out.extend(loc for loc in known if _matches(loc, cloud, region, zone))
            if cloud and region and zone:
                out.append(Location(cloud, region, zone))
        return list(dict.fromkeys(out))

    def policy_params(self) -> ServiceParams:
        policy = self.service.replica_policy
        acc = self.accelerator
        return ServiceParams(
            num_overprovision=policy.num_overprovision,
            base_ondemand_fallback_replicas=policy.base_ondemand_fallback_replicas,
            dynamic_ondemand_fallback=policy.dynamic_ondemand_fallback,
            use_spot=self.use_spot,
            accelerator=acc.name if acc else None,
            accelerator_count=acc.count if acc else 1,
        )

    def to_dict(self) -> dict[str, Any]:
        """A plain, normalized mapping (YAML/JSON-ready): parse_spec(spec.to_dict()) == spec."""
        return {
            "name": self.name,
            **plain(self.task),
            "service": _service_to_dict(self.service),
            "resources": _resources_to_dict(self.resources),
            "engine": _compact(dataclasses.asdict(self.engine) | {"args": list(self.engine.args)}),
            "kv": dataclasses.asdict(self.kv),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _matches(loc: Location, cloud: str | None, region: str | None, zone: str | None) -> bool:
    return (
        (cloud is None or loc.cloud == cloud)
        and (region is None or loc.region == region)
        and (zone is None or loc.zone == zone)
    )


# ---- serialization --------------------------------------------------------------------


def plain(value: Any) -> Any:
    """Mappings/tuples to dicts/lists, recursively (what YAML and JSON write)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _compact(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: plain(v) for k, v in d.items() if v is not None and v != {} and v != ()}


def _service_to_dict(s: ServiceSection) -> dict[str, Any]:
    out: dict[str, Any] = {"readiness_probe": _compact(dataclasses.asdict(s.readiness_probe))}
    if s.replicas is not None:
        out["replicas"] = s.replicas
    else:
        out["replica_policy"] = _compact(dataclasses.asdict(s.replica_policy))
    out["load_balancing_policy"] = s.load_balancing_policy
    out["placement_policy"] = s.placement_policy
    if s.ports is not None:
        out["ports"] = s.ports
    if s.tls is not None:
        out["tls"] = dataclasses.asdict(s.tls)
    return out | plain(s.extra)


def _resources_to_dict(r: Resources) -> dict[str, Any]:
    out = _compact(
        {
            "cloud": r.cloud,
            "region": r.region,
            "zone": r.zone,
            "instance_type": r.instance_type,
            "use_spot": r.use_spot,
            "accelerators": [str(a) for a in r.accelerators] or None,
            "ports": list(r.ports) or None,
            ("ordered" if r.ordered else "any_of"): [_resources_to_dict(alt) for alt in r.any_of] or None,
        }
    )
    return out | plain(r.extra)
