"""The daemon's bearer token: generated on first start, kept in a 0600 file beside the state."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from orchestrator.common import paths
def token_path() -> Path:
    return paths.home() / "token"


def load_or_create_token() -> str:
    path = token_path()
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_urlsafe(32)
    # O_EXCL + 0600: never readable by others, and two daemons starting at once cannot
    # each write a different token (the loser reads the winner's).
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def read_token() -> str | None:
    path = token_path()
    return path.read_text().strip() if path.exists() else None


def token_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())
