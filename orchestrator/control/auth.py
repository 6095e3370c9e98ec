"""Who is calling the daemon's API: the operator, a service, or one replica of a service.

Three kinds of bearer credentials, each kept in a 0600 file under the state directory:
- the operator's token (`<state>/token`, generated on first start; the CLI presents it): every route;
- a service's KV secret (`<state>/services/<name>/kv.secret`, which its shard stores also check):
  that service's membership only;
- a replica's token (orchestrator.common.identity), derived from the service's identity key
  (`<state>/services/<name>/identity.key`, which never leaves this host) and the replica's row
  (its id and creation time: a service that reuses a name does not revive old tokens): that
  service's membership, and notices for that replica's own instance, until the replica ends.
`identify` turns a presented token into a `Caller`; orchestrator.control.api calls it before it
reads a request's body and checks each route's scope with `Caller.may_use`. The launcher
(control.launch) and the bootstrap redemption hand out replica tokens (`replica_token_for`).
"""

from __future__ import annotations

import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from orchestrator.common import identity, paths
from orchestrator.fleet.lifecycle import ReplicaState, is_terminal

OPERATOR, SERVICE, REPLICA = "operator", "service", "replica"


def token_path() -> Path:
    return paths.home() / "token"


def private_secret(path: Path) -> str:
    """The secret in `path`, created (random, mode 0600) when the file is missing or empty."""
    if path.exists():
        secret = path.read_text().strip()
        if secret:
            return secret
        path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL + 0600: never readable by others, and two processes creating it at once cannot
    # each write a different secret (the loser reads the winner's).
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    secret = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return secret


def load_or_create_token() -> str:
    return private_secret(token_path())


def read_token() -> str | None:
    path = token_path()
    return path.read_text().strip() if path.exists() else None


def token_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and bool(expected) and hmac.compare_digest(presented.encode(), expected.encode())


def service_secret_path(service: str, name: str) -> Path:
    """Where a service's secret `name` lives (its folder is not created here)."""
    return paths.home() / "services" / service / name


def _existing_secret(service: str, name: str) -> str | None:
    path = service_secret_path(service, name)
    try:
        return path.read_text().strip() or None
    except OSError:  # missing, or a name that is no folder of ours
        return None


def _epoch(created_at: float) -> str:
    return repr(float(created_at))


def replica_token_for(replica) -> str:
    """The token of `replica` (a ReplicaRow); the service's identity key is created on first use."""
    key = private_secret(service_secret_path(replica.service, "identity.key"))
    return identity.replica_token(key, replica.service, _epoch(replica.created_at), replica.replica_id)


@dataclass(frozen=True)
class Caller:
    """An authenticated caller. `service` is None for the operator; `instance_id` is a
    replica's own instance (None until its launch recorded one)."""

    kind: str
    service: str | None = None
    replica_id: str | None = None
    instance_id: str | None = None

    def may_use(self, service: str) -> bool:
        """May this caller read or report for `service`?"""
        return self.kind == OPERATOR or self.service == service

    def describe(self) -> str:
        if self.kind == REPLICA:
            return f"replica {self.replica_id} of service {self.service!r}"
        return "the operator" if self.kind == OPERATOR else f"service {self.service!r}"


def identify(presented: str | None, operator_token: str, store) -> Caller | None:
    """The caller a bearer token names, or None when it names nobody (wrong, forged, or a
    replica that has ended). `store` is the daemon's orchestrator.control.store.Store."""
    if not presented:
        return None
    if token_matches(presented, operator_token):
        return Caller(OPERATOR)
    claim = identity.parse(presented)
    if claim is not None:
        replica = store.get_replica(claim.replica_id)
        key = _existing_secret(claim.service, "identity.key")
        if replica is None or key is None or replica.service != claim.service:
            return None
        if is_terminal(ReplicaState(replica.state)) or not identity.verify(claim, key, _epoch(replica.created_at)):
            return None
        return Caller(REPLICA, claim.service, claim.replica_id, replica.instance_id)
    for row in store.list_services():
        secret = _existing_secret(row.name, "kv.secret")
        if secret is not None and token_matches(presented, secret):
            return Caller(SERVICE, row.name)
    return None
