"""Plumbing the AWS, GCP and Azure adapters share: SDK calls with typed errors and the one
backoff, the boot script a cloud VM runs to start its replica, and the port tag that lets a
listed VM be reached again (its endpoint)."""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from typing import TypeVar

from orchestrator.common.retry import retry
from providers.base import LaunchRequest, Location, Market, ProviderError, TransientError

T = TypeVar("T")
# The engine's port, kept on the VM itself, so a restarted daemon can still reach a VM it adopts;
# and all its ports (engine-agent-control), for the agent's and the connector's endpoints.
TAG_PORT = "spot-orchestrator-port"
TAG_PORTS = "spot-orchestrator-ports"
# Which of a VM's addresses the daemon (and its load balancer) reach it at: public (the default:
# a daemon outside the VPC) or private (a daemon inside it, or the emulated clouds of the tests).
ADDRESS_ENV = "SPOT_ORCHESTRATOR_REPLICA_ADDRESS"
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


def user_data(request: LaunchRequest) -> str:
    """What the VM runs at boot: the daemon's boot script, or (a request built by hand) a
    script that runs its command."""
    return request.boot_script or startup_script(request)


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
    if request.ports:
        tags[TAG_PORTS] = "-".join(str(p) for p in request.ports)
    return tags


def endpoint(host: str | None, tags: dict[str, str]) -> str | None:
    """The engine's URL on a VM: its address and the port it was tagged with; None until both are known."""
    port = tags.get(TAG_PORT)
    return f"http://{host}:{port}" if host and port else None


def endpoints(host: str | None, tags: dict[str, str]) -> tuple[str | None, str | None, str | None]:
    """(engine, agent, KV control) URLs of a VM, from its address and its ports tag."""
    ports = tags.get(TAG_PORTS, "").split("-")
    if not host or len(ports) != 3 or not all(p.isdigit() for p in ports):
        return endpoint(host, tags), None, None
    engine, agent, control = (f"http://{host}:{p}" for p in ports)
    return engine, agent, control


def reachable_address(public: str | None, private: str | None) -> str | None:
    """The address the daemon uses for a VM (see ADDRESS_ENV); raises ProviderError for a bad setting."""
    kind = os.environ.get(ADDRESS_ENV, "public").strip().lower()
    if kind not in ("public", "private"):
        raise ProviderError(f"{ADDRESS_ENV}={kind!r}: expected public or private")
    return (public or private) if kind == "public" else private
