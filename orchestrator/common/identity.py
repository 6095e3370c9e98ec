"""Per-replica credentials: a bearer token that names one replica of one service.

The daemon derives each replica's token (`replica_token`) from a key only it holds, one per
service (orchestrator.control.auth keeps it in the service's state folder; it never leaves the
daemon's host), over the service's name, its creation time and the replica id. A replica gets
its token at launch (local cloud: the environment; a VM: the bootstrap redemption, which puts it
into the environment too) and presents it for its notices and its membership reads; the daemon
reads the claimed replica from the token (`parse`) and checks it (`verify`). A replica holds the
service's KV secret as well, and so could derive nothing: the key is not that secret.
Standard library only: imported by the daemon (control.auth, control.launch, control.api) and by
the replica side (the agent's notice reporter, the KV connector's membership).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from dataclasses import dataclass

# The replica side finds its token here (set by the launcher, or by the bootstrap redemption).
REPLICA_TOKEN_ENV = "SPOT_ORCHESTRATOR_REPLICA_TOKEN"
_PREFIX = "spr1"


@dataclass(frozen=True)
class ReplicaClaim:
    """Who a replica token says it is (not yet verified)."""

    service: str
    replica_id: str
    token: str


def _mac(key: str, service: str, epoch: str, replica_id: str) -> str:
    digest = hmac.new(key.encode(), f"{service}\n{epoch}\n{replica_id}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def replica_token(key: str, service: str, epoch: str, replica_id: str) -> str:
    """The token of `replica_id` of `service`; `epoch` tells apart services that reuse a name."""
    return f"{_PREFIX}.{service}.{replica_id}.{_mac(key, service, epoch, replica_id)}"


def parse(token: str | None) -> ReplicaClaim | None:
    """The claim a token makes, or None when it is no replica token (e.g. the operator's)."""
    if not token or not token.startswith(_PREFIX + "."):
        return None
    parts = token.split(".")
    if len(parts) != 4 or not all(parts[1:]):
        return None
    return ReplicaClaim(parts[1], parts[2], token)


def verify(claim: ReplicaClaim, key: str, epoch: str) -> bool:
    """True when the claim's token is the one `key` gives this replica (constant time)."""
    expected = replica_token(key, claim.service, epoch, claim.replica_id)
    return hmac.compare_digest(expected.encode(), claim.token.encode())


def own_token(fallback: str) -> str:
    """This replica's token from its environment; `fallback` (the service's KV secret) when
    none was given, which the daemon accepts for membership reads only."""
    return os.environ.get(REPLICA_TOKEN_ENV) or fallback
