"""What the daemon asks of "the service's load balancer", wherever it runs.

Two implementations of one interface: `InProcessBalancers` here (LoadBalancer objects in the
daemon's process: what tests that build a Daemon in-process use) and
orchestrator.control.dataplane.RemoteBalancers (the data-plane process that outlives the
daemon: what `serve()` uses). The daemon keeps each service's `ServiceBalancer` in `Daemon.lbs`;
the controllers publish replica sets to it, the migrator drains and migrates through it, and
`Daemon.cost` reads its token count.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable
from typing import Protocol

from orchestrator.lb.proxy import LoadBalancer, MigrationResult, Upstream


class ServiceBalancer(Protocol):
    """One service's load balancer (orchestrator.lb.proxy.LoadBalancer is one)."""

    url: str | None

    def set_replicas(self, upstreams: Iterable[Upstream]) -> None: ...

    def drain(self, replica_ids: Iterable[str]) -> None: ...

    def migrate(self, replica_id: str, before_cut: Callable[[], object] | None = None,
                resume_timeout: float = 120.0, *,
                before_resume: Callable[[], object] | None = None) -> concurrent.futures.Future[MigrationResult]: ...

    def output_tokens(self) -> tuple[int, float]: ...


class Balancers(Protocol):
    """Starts, adopts and stops the services' load balancers."""

    def open(self, name: str, host: str, port: int, tls: tuple[str, str] | None, policy: str) -> ServiceBalancer:
        """The service's LB serving on host:port: the running one when its port and TLS are the
        same (a stream in flight does not notice; a changed policy applies in place), else a new one.
        UserError: cannot listen."""

    def adopt(self, names: Iterable[str]) -> None:
        """On start: keep the running LBs of these services, stop every other one."""

    def stop(self, name: str) -> None: ...

    def check(self) -> None:
        """Called by the probe job: brings back a host process that died."""

    def metrics_text(self) -> bytes:
        """The LBs' metrics for the daemon's /metrics (empty when they serve their own)."""

    def shutdown(self) -> None:
        """The daemon exits: in-process LBs stop; a data plane keeps serving."""


class InProcessBalancers:
    """Each service's LoadBalancer in a thread of the daemon (they die with it)."""

    def __init__(self):
        self.lbs: dict[str, LoadBalancer] = {}

    def open(self, name: str, host: str, port: int, tls: tuple[str, str] | None, policy: str) -> LoadBalancer:
        lb = self.lbs.get(name)
        if lb is not None and (lb.url or "").startswith("https") != bool(tls):  # TLS switched on or off
            self.lbs.pop(name).stop()
            lb = None
        if lb is None:
            lb = LoadBalancer(policy=policy)
            lb.start(host, port, tls)
            self.lbs[name] = lb
        elif lb.policy != policy:  # an update: in place, no replica replaced
            lb.set_policy(policy)
        return lb

    def adopt(self, names: Iterable[str]) -> None:
        return None  # a new process has none to adopt

    def stop(self, name: str) -> None:
        lb = self.lbs.pop(name, None)
        if lb is not None:
            lb.stop()

    def check(self) -> None:
        return None

    def metrics_text(self) -> bytes:
        return b""

    def shutdown(self) -> None:
        for name in list(self.lbs):
            self.stop(name)
