"""Plumbing the AWS, GCP and Azure adapters share: SDK calls with typed errors and the one
backoff, and the boot script a cloud VM runs to start its replica."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from typing import TypeVar

from orchestrator.retry import retry
from providers.base import LaunchRequest, Location, Market, ProviderError, TransientError

T = TypeVar("T")
ErrorMap = Callable[[Exception, Location | None, Market | None], ProviderError]


def call(fn: Callable[[], T], map_error: ErrorMap, location: Location | None = None, market: Market | None = None,
         *, attempts: int = 5, sleep: Callable[[float], None] = time.sleep) -> T:
    """fn(), its SDK errors mapped to typed errors by the cloud's `map_error`; throttling and
    passing faults (TransientError) retried with orchestrator.retry's backoff."""

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
