"""The clouds this installation knows: providers registered under an entry-point group.

Group `spot_orchestrator.providers` maps a cloud's name to its Provider class (or a
zero-argument factory). The daemon builds each cloud's provider on first use (`make`); the
control plane checks a spec's clouds with `check`. A package outside this repository adds
a cloud with an entry point, as policies are added. Import-light: no SDK is imported until
a provider is made.
"""

from __future__ import annotations

import difflib
from importlib import metadata

from orchestrator.common.errors import UserError
from providers.base import Provider

ENTRY_POINT_GROUP = "spot_orchestrator.providers"
# The in-VM halves: each cloud's metadata watcher, run by the replica agent.
WATCHER_ENTRY_POINT_GROUP = "spot_orchestrator.notice_watchers"
# Where a service that names no cloud runs: the local cloud, which needs no account.
DEFAULT_CLOUD = "local"


class UnknownCloudError(UserError):
    """A cloud name no provider is registered for."""


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    """The registered clouds, sorted."""
    return sorted(_entry_points())


def check(cloud: str, field: str = "resources.cloud") -> None:
    """Raises UnknownCloudError (one line, with a did-you-mean) unless `cloud` is registered."""
    known = names()
    if cloud in known:
        return
    close = difflib.get_close_matches(cloud, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownCloudError(f"{field}: unknown cloud {cloud!r}{hint} (registered: {', '.join(known) or 'none'})")


def provider_class(cloud: str) -> type[Provider]:
    """The Provider class registered for `cloud` (nothing is constructed); raises UnknownCloudError."""
    check(cloud)
    cls = _entry_points()[cloud].load()
    if not (isinstance(cls, type) and issubclass(cls, Provider)):
        raise TypeError(f"the entry point for cloud {cloud!r} is not a Provider class")
    return cls


def make(cloud: str) -> Provider:
    """A new provider of that cloud with its default settings; raises UnknownCloudError."""
    check(cloud)
    provider = _entry_points()[cloud].load()()
    if not isinstance(provider, Provider):
        raise TypeError(f"the entry point for cloud {cloud!r} did not produce a Provider")
    return provider
