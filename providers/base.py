"""The Provider interface: the whole contract a cloud must implement, and its value types.

Kept small, like Karpenter's cloud provider interface: everything clever (placement, hedging,
migration) lives above it, and nothing above it branches on a cloud's name. The control plane
(orchestrator/control) calls these methods; policies and the simulator import only the value
types. Each method's docstring says what it must do and what it raises; every error is one of
the typed errors below, with a one-line message fit to show a user.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import time
from collections.abc import Iterable, Sequence
from pathlib import Path


class Market(str, enum.Enum):
    SPOT = "spot"
    ON_DEMAND = "on_demand"


class NoticeKind(str, enum.Enum):
    PREEMPT = "preempt"
    REBALANCE = "rebalance"
    MAINTENANCE = "maintenance"


@dataclasses.dataclass(frozen=True, order=True)
class Location:
    """A failure domain leaf: cloud > region > zone."""

    cloud: str
    region: str
    zone: str

    def __str__(self) -> str:
        return f"{self.cloud}/{self.region}/{self.zone}"

    @classmethod
    def parse(cls, text: str) -> Location:
        parts = text.split("/")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"location {text!r}: expected CLOUD/REGION/ZONE")
        return cls(*parts)


@dataclasses.dataclass(frozen=True)
class Offer:
    """One price quote: an instance type in a location on one market.

    `observed_at` is when the price was taken (unix seconds) and `source` where it came from:
    "live" (the cloud's price API), "catalog" (a SkyPilot catalog file), "snapshot" (the catalog
    shipped with spot-orchestrator), or "" when the caller did not say.
    """

    location: Location
    instance_type: str
    accelerator: str
    accelerator_count: int
    market: Market
    price_per_hour: float
    observed_at: float = dataclasses.field(default_factory=time.time)
    source: str = ""

    @property
    def price_per_accelerator_hour(self) -> float:
        return self.price_per_hour / max(1, self.accelerator_count)


class Offers(list):
    """A list of offers with the few named operations policies need (Karpenter-style)."""

    def spot(self) -> Offers:
        return Offers(o for o in self if o.market is Market.SPOT)

    def on_demand(self) -> Offers:
        return Offers(o for o in self if o.market is Market.ON_DEMAND)

    def compatible(self, accelerator: str | None, count: int | None = None) -> Offers:
        acc = accelerator.lower() if accelerator else None
        return Offers(
            o
            for o in self
            if (acc is None or o.accelerator.lower() == acc) and (count is None or o.accelerator_count == count)
        )

    def in_locations(self, locations: Iterable[Location]) -> Offers:
        wanted = set(locations)
        return Offers(o for o in self if o.location in wanted)

    def cheapest(self) -> Offer | None:
        return min(self, key=lambda o: o.price_per_hour, default=None)

    def sorted_by_price(self) -> Offers:
        return Offers(sorted(self, key=lambda o: (o.price_per_hour, str(o.location), o.instance_type)))


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """One replica's machine, as the policy's offer chose it (cloud, zone, type, market)."""

    service: str
    replica_id: str
    location: Location
    market: Market
    instance_type: str
    accelerator: str | None = None
    accelerator_count: int = 0
    # What the replica runs, for machines on this host (MachineRuntime.on_this_host): the
    # command line and environment, with {port}/{agent_port}/{control_port} placeholders.
    command: Sequence[str] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # The engine's port (for the endpoint) and every port the replica listens on.
    port: int | None = None
    ports: tuple[int, ...] = ()
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    # For a VM: the rendered boot script (user-data, startup-script, customData) and the image
    # (None: the provider's default image with NVIDIA drivers).
    boot_script: str | None = None
    image_id: str | None = None
    price_per_hour: float | None = None
    # Which `up` of the service this replica belongs to (new whenever a service that is not
    # running comes up): replica ids start again at 1 after a `down`, so the token and the
    # tags need it to tell a new replica from an old one of the same id.
    incarnation: str = ""

    @property
    def launch_key(self) -> str:
        """The replica's name across every up of its service: service, incarnation, replica."""
        parts = (self.service, self.incarnation, self.replica_id) if self.incarnation else (self.service,
                                                                                            self.replica_id)
        return "-".join(parts)

    @property
    def client_token(self) -> str:
        """Idempotency token: a retried launch of the same replica never makes a second VM
        (and a replica of a later incarnation with the same id never gets the old one)."""
        return self.launch_key[:64]

    def all_tags(self) -> dict[str, str]:
        """The tags every provider puts on the machine: what `list` finds it by and what tells
        the daemon whose it is (service, incarnation, replica) after a crash or a lost state."""
        tags = {**self.tags, TAG_SERVICE: self.service, TAG_REPLICA: self.replica_id, TAG_MANAGED: "true"}
        if self.incarnation:
            tags[TAG_INCARNATION] = self.incarnation
        return tags


TAG_SERVICE = "spot-orchestrator-service"
TAG_REPLICA = "spot-orchestrator-replica"
TAG_INCARNATION = "spot-orchestrator-incarnation"
TAG_MANAGED = "spot-orchestrator-managed"


class InstanceStatus(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    TERMINATED = "terminated"


@dataclasses.dataclass
class Instance:
    """A machine as the cloud reports it; endpoints are filled once its address is known."""

    instance_id: str
    location: Location
    market: Market
    instance_type: str
    status: InstanceStatus
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    # Where the replica's engine answers (http://host:port); None until known.
    endpoint: str | None = None
    # Where the replica agent (notice watcher + KV shard store) answers; None until known.
    agent_endpoint: str | None = None
    # The KV connector's control endpoint inside the engine (flush on notice); None if none.
    control_endpoint: str | None = None
    launched_at: float = dataclasses.field(default_factory=time.time)
    price_per_hour: float | None = None

    @property
    def replica_id(self) -> str | None:
        return self.tags.get(TAG_REPLICA)

    @property
    def service(self) -> str | None:
        return self.tags.get(TAG_SERVICE)

    @property
    def incarnation(self) -> str | None:
        return self.tags.get(TAG_INCARNATION)


@dataclasses.dataclass(frozen=True)
class Notice:
    """A warning that an instance is about to go away."""

    instance_id: str
    kind: NoticeKind
    deadline: float  # unix seconds; may already be in the past
    source: str = ""
    received_at: float = dataclasses.field(default_factory=time.time)


# ---- typed errors: callers branch on meaning, not on strings -------------------------


class ProviderError(Exception):
    """Base class; the message is a single line fit to show a user."""


class CapacityError(ProviderError):
    """No capacity of that kind in that location right now (feeds the policy's hazard)."""

    def __init__(self, message: str, location: Location | None = None, market: Market | None = None):
        super().__init__(message)
        self.location = location
        self.market = market


class QuotaError(ProviderError):
    """The account's quota forbids the launch; retrying will not help."""


class TransientError(ProviderError):
    """Throttling or a passing fault: retry with backoff."""


class AuthError(ProviderError):
    """Credentials are missing or rejected; the message says how to configure them."""


class NotFoundError(ProviderError):
    """The instance does not exist (ignored on terminate)."""


def is_capacity_error(err: BaseException) -> bool:
    return isinstance(err, CapacityError)


def is_not_found(err: BaseException) -> bool:
    return isinstance(err, NotFoundError)


@dataclasses.dataclass(frozen=True)
class MachineRuntime:
    """How a provider's machines run the replica program; the launcher reads it, so that the
    control plane never branches on a cloud's name."""

    python: str = "python3"  # the replica runtime's interpreter, for machines on this host
    bind_host: str = "{host}"  # the address the engine and agent listen on ({host}: the VM's own)
    on_cpu: bool = False  # the engine is vLLM's CPU build (eager mode, bf16, 32-token blocks)
    # The machines are processes of this host: they read its files (a secret by path), reach
    # its loopback, and run `LaunchRequest.command` as is; other machines run the boot script.
    on_this_host: bool = False
    notice_watcher: str | None = None  # the in-VM notice watcher's entry point name, if any


@dataclasses.dataclass(frozen=True)
class ServiceNetwork:
    """What `Provider.prepare_network` opens for one service: the replicas' ports, to the
    daemon's address(es) and to the service's own replicas, nothing else."""

    service: str
    ports: tuple[int, ...]
    allowed_cidrs: tuple[str, ...]  # e.g. the daemon's public address as "203.0.113.5/32"
    regions: tuple[str, ...]  # where the service's replicas may run


class Instances(list):
    """What `Provider.list` returns: the instances found, and the regions that could not be
    read this time (their instances are unknown, not gone: the controller must not count
    them as preempted)."""

    def __init__(self, items: Iterable[Instance] = (), unknown_regions: Iterable[str] = ()):
        super().__init__(items)
        self.unknown_regions = frozenset(unknown_regions)

    def by_id(self) -> dict[str, Instance]:
        return {i.instance_id: i for i in self}


class Provider(abc.ABC):
    """What a cloud must implement. Registered under the entry-point group
    `spot_orchestrator.providers` (providers/registry.py), built with no arguments; settings come
    from the cloud's usual credentials and SPOT_ORCHESTRATOR_* variables."""

    name: str = "base"
    # True when offers() is cheap and current (it reads local state): the controller asks it
    # on every pass. Otherwise the daemon's price book caches the cloud's quotes.
    cheap_offers: bool = False
    # True when the machines are processes of this host (MachineRuntime.on_this_host).
    machines_on_this_host: bool = False

    # ---- prices and places ---------------------------------------------------------------

    @abc.abstractmethod
    def offers(self, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
        """Current price quotes, both markets, for machines with that accelerator (and count;
        all when None), in every location the provider serves. Raises AuthError,
        TransientError or ProviderError; never returns a partial list silently."""

    @classmethod
    def snapshot_offers(cls, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
        """Offers from the price snapshot shipped with the provider: no credentials, no network,
        no provider object (`spotctl up --dry-run` plans with these). Default: none."""
        return []

    def locations(self, accelerator: str | None = None) -> list[Location]:
        """Where machines with that accelerator can run (all locations when None), sorted.
        The default reads them off `offers()`; a provider with a cheaper source overrides it."""
        return sorted({o.location for o in self.offers(accelerator)})

    def runtime(self) -> MachineRuntime:
        """How this cloud's machines run the replica program (see MachineRuntime)."""
        return self.vm_runtime()

    @classmethod
    def vm_runtime(cls) -> MachineRuntime:
        """The runtime of a cloud whose machines are VMs that run the boot script; known without
        a provider object (the dry run asks the class)."""
        return MachineRuntime(notice_watcher=cls.name)

    # ---- the service's network -------------------------------------------------------------

    def prepare_network(self, network: ServiceNetwork) -> None:  # noqa: B027 - optional hook
        """Make (idempotently) what the service's replicas need to be reached: a security
        group / firewall rule / NSG that opens `network.ports` only to `allowed_cidrs` and to
        the service's own replicas, in each of `network.regions`. Called before the service's
        first launch and again on every `up`. Raises AuthError, QuotaError, ProviderError."""

    def remove_network(self, service: str, regions: Iterable[str] | None = None) -> None:  # noqa: B027
        """Remove what `prepare_network` made for the service in `regions` (the provider's own
        when None), at `down` after its last instance is gone; what is already gone is not an
        error. Raises TransientError while instances still hold it."""

    # ---- instances -------------------------------------------------------------------------

    @abc.abstractmethod
    def launch(self, request: LaunchRequest) -> Instance:
        """Start one machine of `request.instance_type` in `request.location` on
        `request.market`, running `request.boot_script` (a VM) or `request.command` (a machine
        on this host), tagged with `request.all_tags()`. Idempotent on `request.client_token`:
        a retried launch returns the machine the first one made. Raises CapacityError (no
        capacity there now: the policy learns from it), QuotaError, AuthError, TransientError."""

    @abc.abstractmethod
    def get(self, instance_id: str) -> Instance | None:
        """The instance with its endpoints as of now (filled once it has an address), or None
        when it no longer exists (a terminated one counts as gone)."""

    @abc.abstractmethod
    def list(self, tags: dict[str, str] | None = None, regions: Iterable[str] | None = None) -> Instances:
        """Instances carrying all the given tags (all managed ones when None), in `regions`
        (the provider's own when None), with their endpoints as of now. A region that cannot
        be read goes into `Instances.unknown_regions` instead of failing the others; raises
        AuthError when none can be read for lack of credentials."""

    @abc.abstractmethod
    def terminate(self, instance_id: str) -> None:
        """Stop and delete the machine and everything it owns (disks, NICs, addresses); a
        missing instance is not an error. Raises TransientError or ProviderError."""

    # ---- notices and the rest -----------------------------------------------------------------

    def notices(self) -> list[Notice]:
        """Control-plane notices seen since the last call (clouds without a feed return [])."""
        return []

    def log_path(self, instance_id: str) -> Path | None:
        """A file on this host holding the instance's output, or None (a VM's console log
        stays with its cloud)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients, threads, processes the provider holds."""
