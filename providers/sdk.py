"""Plumbing the AWS, GCP and Azure adapters share: SDK calls with typed errors and the one
backoff, the boot script a cloud VM runs to start its replica, and the port tag that lets a
listed VM be reached again (its endpoint)."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from typing import TypeVar

from orchestrator.common.retry import retry
from providers.base import LaunchRequest, Location, Market, ProviderError, TransientError

T = TypeVar("T")
# The engine's port, kept on the VM itself, so a restarted daemon can still reach a VM it adopts.
TAG_PORT = "spot-orchestrator-port"
ErrorMap = Callable[[Exception, Location | None, Market | None], ProviderError]


def call(fn: Callable[[], T], map_error: ErrorMap, location: Location | None = None, market: Market | None = None,
         *, attempts: int = 5, sleep: Callable[[float], None] = time.sleep) -> T:
    """fn(), its SDK errors mapped to typed errors by the cloud's `map_error`; throttling and
    passing faults (TransientError) retried with orchestrator.common.retry's backoff."""

    def attempt() -> T:
        try:
            return fn()
        except Exception as err:  # mapped: typed errors pass through unchanged
            raise map_error(err, location, market) from err

    return retry(attempt, retry_on=(TransientError,), attempts=attempts, sleep=sleep)


def startup_script(request: LaunchRequest) -> str:
    """A POSIX shell script exporting the replica's environment and exec-ing its command."""
    lines = ["#!/bin/bash", "set -euo pipefail"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(request.env.items())]
    if request.command:
        lines.append("exec " + " ".join(shlex.quote(part) for part in request.command))
    return "\n".join(lines) + "\n"


def launch_tags(request: LaunchRequest) -> dict[str, str]:
    """The tags (GCP: labels) a replica's VM is created with: the request's, plus its port."""
    tags = request.all_tags()
    if request.port is not None:
        tags[TAG_PORT] = str(request.port)
    return tags


def endpoint(host: str | None, tags: dict[str, str]) -> str | None:
    """The engine's URL on a VM: its address and the port it was tagged with; None until both are known."""
    port = tags.get(TAG_PORT)
    return f"http://{host}:{port}" if host and port else None
