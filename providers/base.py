"""The Provider interface: the whole contract a cloud must implement, and its value types.

Kept deliberately small, like Karpenter's cloudprovider interface: everything clever
(placement, hedging, migration) lives above it. Policies and the simulator import the
value types from here, never the other way round.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import time
from collections.abc import Iterable, Sequence


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
    service: str
    replica_id: str
    location: Location
    market: Market
    instance_type: str
    accelerator: str | None = None
    accelerator_count: int = 0
    # What the replica runs: the engine command line and environment (providers that start
    # machines put this in the startup script; the local cloud runs it as a process).
    command: Sequence[str] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    port: int | None = None
    tags: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def client_token(self) -> str:
        """Idempotency token: a retried launch of the same replica never makes a second VM."""
        return f"{self.service}-{self.replica_id}"[:64]

    def all_tags(self) -> dict[str, str]:
        return {**self.tags, TAG_SERVICE: self.service, TAG_REPLICA: self.replica_id, TAG_MANAGED: "true"}


TAG_SERVICE = "spot-orchestrator-service"
TAG_REPLICA = "spot-orchestrator-replica"
TAG_MANAGED = "spot-orchestrator-managed"


class InstanceStatus(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    TERMINATED = "terminated"


@dataclasses.dataclass
class Instance:
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


class Provider(abc.ABC):
    """What a cloud must implement. Every instance it creates carries `LaunchRequest.all_tags()`."""

    name: str = "base"

    @abc.abstractmethod
    def offers(self, accelerator: str | None = None, count: int | None = None) -> list[Offer]:
        """Current price quotes, both markets, for the given accelerator (all when None)."""

    @abc.abstractmethod
    def launch(self, request: LaunchRequest) -> Instance:
        """Start an instance; idempotent on `request.client_token`. Raises typed errors."""

    @abc.abstractmethod
    def terminate(self, instance_id: str) -> None:
        """Stop and delete; a missing instance is not an error."""

    @abc.abstractmethod
    def get(self, instance_id: str) -> Instance | None:
        """The instance, or None when it no longer exists."""

    @abc.abstractmethod
    def list(self, tags: dict[str, str] | None = None) -> list[Instance]:
        """Instances carrying all the given tags (all managed instances when None)."""

    def notices(self) -> list[Notice]:
        """Control-plane notices seen since the last call (clouds without a feed return [])."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients, threads, processes the provider holds."""
