"""An in-memory cloud for the daemon at scale (tests/benchmarks/bench_daemon_scale.py): launches
are dict inserts, instances are found by their service tag in O(that service), and every
machine's engine is one path under a single health stand-in (tests/fakes/health_standin.py),
so thousands of replicas cost the daemon what its own code costs, not what machines cost."""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Iterable

from orchestrator.control.launch import ReplicaLauncher
from providers.base import (
    TAG_SERVICE,
    Instance,
    Instances,
    InstanceStatus,
    LaunchRequest,
    Location,
    Market,
    MachineRuntime,
    Offer,
    Provider,
)

INSTANCE_TYPE = "mem.gpu"


class MemoryCloud(Provider):
    """Machines that exist only as records, in two zones of one region of the cloud `name` (the
    one the specs name: it stands in for that cloud's provider); `health_url` is where their
    engines answer, each at `<health_url>/m/<instance id>`. Thread-safe: launches run on the
    controllers' pools."""

    cheap_offers = True
    machines_on_this_host = True

    def __init__(self, name: str = "local", health_url: str = "http://127.0.0.1:9"):
        self.name = name
        self.health_url = health_url.rstrip("/")
        self._by_service: dict[str, dict[str, Instance]] = defaultdict(dict)
        self._service_of: dict[str, str] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._offers = [Offer(z, INSTANCE_TYPE, "A10G", 1, market, price)
                        for z in (Location(name, f"{name}-1", f"{name}-a"), Location(name, f"{name}-1", f"{name}-b"))
                        for market, price in ((Market.SPOT, 0.4), (Market.ON_DEMAND, 1.2))]

    def offers(self, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
        return list(self._offers)

    def runtime(self) -> MachineRuntime:
        return MachineRuntime(on_this_host=True)

    def launch(self, request: LaunchRequest) -> Instance:
        with self._lock:
            instance_id = f"m-{next(self._ids)}"
            inst = Instance(instance_id, request.location, request.market, request.instance_type,
                            InstanceStatus.RUNNING, tags=request.all_tags(),
                            endpoint=f"{self.health_url}/m/{instance_id}", price_per_hour=request.price_per_hour)
            self._by_service[request.service][instance_id] = inst
            self._service_of[instance_id] = request.service
            return inst

    def restore(self, instances: Iterable[Instance]) -> None:
        """Machines that outlived a daemon (a benchmark's fleet, seeded before the daemon starts)."""
        with self._lock:
            for inst in instances:
                self._by_service[inst.service or ""][inst.instance_id] = inst
                self._service_of[inst.instance_id] = inst.service or ""

    def get(self, instance_id: str) -> Instance | None:
        with self._lock:
            return self._by_service.get(self._service_of.get(instance_id, ""), {}).get(instance_id)

    def list(self, tags: dict[str, str] | None = None, regions: Iterable[str] | None = None) -> Instances:
        tags = tags or {}
        with self._lock:
            if TAG_SERVICE in tags:
                pool: Iterable[Instance] = list(self._by_service.get(tags[TAG_SERVICE], {}).values())
            else:
                pool = [i for insts in self._by_service.values() for i in insts.values()]
        return Instances(i for i in pool if all(i.tags.get(k) == v for k, v in tags.items()))

    def terminate(self, instance_id: str) -> None:
        with self._lock:
            service = self._service_of.pop(instance_id, None)
            if service is not None:
                self._by_service[service].pop(instance_id, None)


class MemoryLauncher(ReplicaLauncher):
    """A launch request with nothing to run: the memory cloud's machines are records."""

    def request(self, spec, row, offer, runtime) -> LaunchRequest:
        return LaunchRequest(service=spec.name, replica_id=row.replica_id, location=offer.location,
                             market=offer.market, instance_type=offer.instance_type,
                             price_per_hour=offer.price_per_hour)
