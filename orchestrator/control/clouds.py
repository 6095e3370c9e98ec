"""The clouds one service uses: a provider per cloud, read and acted on together.

A service may span clouds (`resources.any_of` entries naming different clouds); its controller
holds a `Clouds` and asks it to list the service's instances everywhere (`list`: one cloud's
failure makes its regions unknown, never the others' instances gone), for notices, and for the
provider of a location's cloud (`provider(cloud)`). Built by the daemon, one per service.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping

from providers.base import Instance, Notice, Offer, Provider, ProviderError

log = logging.getLogger(__name__)
ANY_REGION = "*"  # a cloud that could not be read at all


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the clouds reported: the instances found, and the (cloud, region) pairs that could
    not be read this time (their instances are unknown, not gone)."""

    instances: tuple[Instance, ...] = ()
    unknown: frozenset[tuple[str, str]] = frozenset()

    def __iter__(self):
        return iter(self.instances)

    def by_id(self) -> dict[str, Instance]:
        return {i.instance_id: i for i in self.instances}

    def unknown_at(self, cloud: str, region: str) -> bool:
        return (cloud, region) in self.unknown or (cloud, ANY_REGION) in self.unknown


class Clouds:
    def __init__(self, providers: Mapping[str, Provider]):
        if not providers:
            raise ValueError("a service needs at least one cloud")
        self._providers = dict(providers)

    @classmethod
    def of(cls, provider: Provider | Clouds) -> Clouds:
        return provider if isinstance(provider, Clouds) else cls({provider.name: provider})

    @property
    def names(self) -> list[str]:
        return sorted(self._providers)

    def provider(self, cloud: str) -> Provider:
        """The provider of `cloud`; raises KeyError for a cloud the service does not use."""
        return self._providers[cloud]

    def offers(self) -> list[Offer]:
        return [o for p in self._providers.values() for o in p.offers()]

    def list(self, tags: dict[str, str], regions: Mapping[str, Iterable[str]] | None = None) -> Observed | None:
        """Instances with the tags on every cloud (in its `regions` when given); None when no
        cloud could be read at all (decide nothing on no facts)."""
        found: list[Instance] = []
        unknown: set[tuple[str, str]] = set()
        for cloud, provider in sorted(self._providers.items()):
            wanted = sorted((regions or {}).get(cloud) or ()) or None
            try:
                listed = provider.list(tags, regions=wanted)
            except ProviderError as err:
                log.warning("%s: listing instances failed: %s", cloud, err)
                unknown.add((cloud, ANY_REGION))
                continue
            found += listed
            unknown |= {(cloud, region) for region in getattr(listed, "unknown_regions", ())}
        if len(unknown) == len(self._providers) and all(region == ANY_REGION for _, region in unknown):
            return None
        return Observed(tuple(found), frozenset(unknown))

    def notices(self) -> list[Notice]:
        out: list[Notice] = []
        for cloud, provider in sorted(self._providers.items()):
            try:
                out += provider.notices()
            except ProviderError as err:
                log.warning("%s: reading notices failed: %s", cloud, err)
        return out
