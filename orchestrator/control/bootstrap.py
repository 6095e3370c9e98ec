"""One-time boot credentials: how a VM gets its secrets without them ever being in user-data.

The launcher issues a token per launch (`BootstrapTokens.issue`) and renders it into the boot
script; only its hash is stored. With it the VM may download the daemon's own wheel until it
redeems the token, and redeem it exactly once (`redeem`) for the service's KV secret and the
spec's environment, presenting its instance id, which must be the one the launch recorded.
Called by orchestrator.control.boot (issue) and the API's /v1/bootstrap routes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from orchestrator.control.store import BootstrapTokenRow, Store

DEFAULT_TTL_S = 3 * 3600.0  # a GPU VM with a cold image can take an hour to boot and install


class BootstrapError(Exception):
    """Why a token was refused; `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Redeemed:
    service: str
    replica_id: str


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class BootstrapTokens:
    def __init__(self, store: Store, ttl_s: float = DEFAULT_TTL_S):
        self.store = store
        self.ttl_s = ttl_s

    def issue(self, service: str, replica_id: str) -> str:
        token = secrets.token_urlsafe(32)
        self.store.add_bootstrap_token(_hash(token), service, replica_id, time.time() + self.ttl_s)
        return token

    def check(self, token: str | None) -> BootstrapTokenRow:
        """The token's row if it is known, unexpired and unused; raises BootstrapError (401)."""
        row = self.store.get_bootstrap_token(_hash(token)) if token else None
        if row is None or not hmac.compare_digest(row.token_hash, _hash(token or "")):
            raise BootstrapError(401, "unknown bootstrap token")
        if row.redeemed_at is not None:
            raise BootstrapError(401, "bootstrap token already used")
        if row.expires_at < time.time():
            raise BootstrapError(401, "bootstrap token expired")
        return row

    def redeem(self, token: str | None, instance_id: str) -> Redeemed:
        """Use the token once for the VM `instance_id`. Raises BootstrapError: 401 (unknown,
        used, expired), 409 (the launch is not recorded yet: retry), 403 (another instance)."""
        row = self.check(token)
        replica = self.store.get_replica(row.replica_id)
        if replica is None:
            raise BootstrapError(401, "the replica of this token is gone")
        if not replica.instance_id:
            raise BootstrapError(409, f"replica {row.replica_id} has no instance recorded yet; retry")
        if replica.instance_id != instance_id:
            raise BootstrapError(403, f"this token belongs to another instance than {instance_id!r}")
        if not self.store.redeem_bootstrap_token(row.token_hash):
            raise BootstrapError(401, "bootstrap token already used")
        return Redeemed(row.service, row.replica_id)
