"""The data plane's admin API: what the daemon asks of the load balancers it hosts.

orchestrator.lb.dataplane serves it on a loopback port; orchestrator.control.dataplane is its
only client. Every route needs the data plane's bearer token.

    GET    /v1/health                             pid, services
    GET    /v1/lbs                                every hosted LB: name, url, policy
    PUT    /v1/lbs/{name}                         start it, or keep the running one (port, TLS, policy)
    DELETE /v1/lbs/{name}                         stop it (the process exits when none is left)
    PUT    /v1/lbs/{name}/replicas                its replica set (LoadBalancer.set_replicas)
    POST   /v1/lbs/{name}/drain                   {"replica_ids"}
    POST   /v1/lbs/{name}/migrations              {"replica_id", "resume_timeout", "hold_timeout"}:
                                                  drain, cut, hold the gate; answers {"id", "held"}
    POST   /v1/lbs/{name}/migrations/{id}/release the daemon's hook ran: continue the cut streams
    GET    /v1/lbs/{name}/migrations/{id}?wait_s= the MigrationResult (202 while it is pending)
    GET    /v1/lbs/{name}/tokens                  output tokens served and since when (spotctl cost)
    GET    /metrics                               every LB's registry, with a service label
    POST   /v1/shutdown                           stop every LB and exit

A migration's gate is released by the daemon, or by the data plane itself after hold_timeout
(a daemon that died between the cut and the release must not hold the streams).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from pydantic import BaseModel

from orchestrator.common.errors import UserError
from orchestrator.lb.proxy import LoadBalancer, MigrationResult, Upstream

log = logging.getLogger(__name__)

RESULT_KEEP_S = 600.0  # a migration result nobody fetched is forgotten after this


class LBConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int
    certfile: str | None = None
    keyfile: str | None = None
    policy: str = "least_load"


class UpstreamIn(BaseModel):
    replica_id: str
    url: str
    ready: bool = True
    draining: bool = False


class DrainIn(BaseModel):
    replica_ids: list[str]


class MigrationIn(BaseModel):
    replica_id: str
    resume_timeout: float = 120.0
    hold_timeout: float = 30.0


@dataclasses.dataclass
class _Migration:
    future: concurrent.futures.Future
    held: threading.Event
    release: threading.Event
    started: float


class DataPlane:
    """The hosted load balancers by service, and their migrations in progress."""

    def __init__(self):
        self.lbs: dict[str, LoadBalancer] = {}
        self.configs: dict[str, LBConfig] = {}
        self.migrations: dict[str, _Migration] = {}
        self.on_empty: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self._closing = False
        self._ever_used = False

    def put(self, name: str, cfg: LBConfig) -> tuple[LoadBalancer, bool]:
        """(its LB, whether it was started now); the running one is kept unless its port or
        TLS changed. Raises UserError when it cannot listen."""
        with self._lock:
            if self._closing:
                raise HTTPException(503, "the data plane is exiting")
            self._ever_used = True
            lb, old = self.lbs.get(name), self.configs.get(name)
            if lb is not None and old is not None and old.port == cfg.port \
                    and bool(old.certfile) == bool(cfg.certfile):
                if lb.policy != cfg.policy:  # a spec update: in place, the streams go on
                    lb.set_policy(cfg.policy)
                self.configs[name] = cfg
                return lb, False
            if lb is not None:
                self.lbs.pop(name).stop()
            lb = LoadBalancer(policy=cfg.policy)
            lb.start(cfg.host, cfg.port, (cfg.certfile, cfg.keyfile) if cfg.certfile and cfg.keyfile else None)
            self.lbs[name], self.configs[name] = lb, cfg
            return lb, True

    def stop(self, name: str) -> None:
        with self._lock:
            lb = self.lbs.pop(name, None)
            self.configs.pop(name, None)
            if lb is not None:
                lb.stop()
            empty = not self.lbs
        if empty:
            threading.Thread(target=self._exit_if_still_empty, args=(EMPTY_GRACE_S,), daemon=True).start()

    def _exit_if_still_empty(self, after_s: float) -> None:
        time.sleep(after_s)
        with self._lock:
            if self.lbs:
                return
            self._closing = True
        log.info("no load balancer left: exiting")
        self.on_empty()

    def exit_if_unused(self, after_s: float) -> None:
        """Called once at start: exit when no LB was ever put within `after_s`."""
        def check() -> None:
            time.sleep(after_s)
            with self._lock:
                if self._ever_used:
                    return
            self._exit_if_still_empty(0)

        threading.Thread(target=check, daemon=True).start()

    @property
    def closing(self) -> bool:
        return self._closing

    def stop_all(self) -> None:
        with self._lock:
            self._closing = True
            lbs, self.lbs = list(self.lbs.values()), {}
        for lb in lbs:
            lb.stop()

    def lb(self, name: str) -> LoadBalancer:
        lb = self.lbs.get(name)
        if lb is None:
            raise HTTPException(404, f"no load balancer for service {name!r}")
        return lb

    # -- migrations ------------------------------------------------------------------------
    def start_migration(self, name: str, body: MigrationIn) -> tuple[str, _Migration]:
        lb = self.lb(name)
        held, release = threading.Event(), threading.Event()

        async def hold() -> None:  # on the LB's loop, between the cut and the resume
            held.set()
            if not await asyncio.to_thread(release.wait, body.hold_timeout):
                log.warning("migration of %s: the daemon did not release the streams within %.0fs; resuming",
                            body.replica_id, body.hold_timeout)

        future = lb.migrate(body.replica_id, resume_timeout=body.resume_timeout, before_resume=hold)
        migration_id = uuid.uuid4().hex
        self._forget_old_migrations()
        self.migrations[migration_id] = _Migration(future, held, release, time.monotonic())
        return migration_id, self.migrations[migration_id]

    def _forget_old_migrations(self) -> None:
        now = time.monotonic()
        for key, m in list(self.migrations.items()):
            if m.future.done() and now - m.started > RESULT_KEEP_S:
                self.migrations.pop(key, None)

    def migration(self, migration_id: str) -> _Migration:
        m = self.migrations.get(migration_id)
        if m is None:
            raise HTTPException(404, f"no migration {migration_id!r}")
        return m


EMPTY_GRACE_S = 2.0  # a `down` then `up` of the only service does not restart the process


def labelled_metrics(lbs: dict[str, LoadBalancer]) -> bytes:
    """Every LB's registry in one scrape, each sample with its service's label."""
    class _Merged:
        def collect(self):
            families: dict[str, Metric] = {}
            for service, lb in sorted(lbs.items()):
                for family in lb.metrics.registry.collect():
                    out = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                    for s in family.samples:
                        out.add_sample(s.name, {"service": service, **s.labels}, s.value, s.timestamp, s.exemplar)
            yield from families.values()

    registry = CollectorRegistry()
    registry.register(_Merged())
    return generate_latest(registry)


def _result(result: MigrationResult) -> dict:
    return {**dataclasses.asdict(result), "continuation_ids": list(result.continuation_ids)}


def create_app(plane: DataPlane, token: str) -> FastAPI:
    app = FastAPI(title="spot-orchestrator data plane", docs_url=None, redoc_url=None, openapi_url=None)
    expected = f"Bearer {token}".encode()

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        presented = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(presented, expected):
            return JSONResponse({"detail": "the data plane's token is required"}, status_code=401)
        return await call_next(request)

    @app.get("/v1/health")
    def health():
        if plane.closing:  # the daemon starts a new one once this one is gone
            return JSONResponse({"status": "exiting", "pid": os.getpid()}, status_code=503)
        return {"status": "ok", "pid": os.getpid(), "services": sorted(plane.lbs)}

    @app.get("/v1/lbs")
    def list_lbs() -> list[dict]:
        return [{"name": name, "url": lb.url, "policy": lb.policy, "port": plane.configs[name].port}
                for name, lb in sorted(plane.lbs.items())]

    @app.put("/v1/lbs/{name}")
    def put_lb(name: str, cfg: LBConfig) -> dict:
        try:
            lb, started = plane.put(name, cfg)
        except UserError as err:
            raise HTTPException(409, str(err)) from None
        return {"name": name, "url": lb.url, "started": started}

    @app.delete("/v1/lbs/{name}")
    def delete_lb(name: str) -> dict:
        plane.stop(name)
        return {"name": name, "stopped": True}

    @app.put("/v1/lbs/{name}/replicas")
    def set_replicas(name: str, upstreams: list[UpstreamIn]) -> dict:
        try:
            plane.lb(name).set_replicas([Upstream(**u.model_dump()) for u in upstreams])
        except UserError as err:
            raise HTTPException(400, str(err)) from None
        return {"replicas": len(upstreams)}

    @app.post("/v1/lbs/{name}/drain")
    def drain(name: str, body: DrainIn) -> dict:
        plane.lb(name).drain(body.replica_ids)
        return {"drained": body.replica_ids}

    @app.post("/v1/lbs/{name}/migrations")
    async def start_migration(name: str, body: MigrationIn) -> dict:
        migration_id, m = plane.start_migration(name, body)
        # Answered once the streams are cut and held, or at once when nothing was in flight.
        while not m.held.is_set() and not m.future.done():
            await asyncio.sleep(0.01)
        return {"id": migration_id, "held": m.held.is_set()}

    @app.post("/v1/lbs/{name}/migrations/{migration_id}/release")
    def release(name: str, migration_id: str) -> dict:
        plane.migration(migration_id).release.set()
        return {"released": True}

    @app.get("/v1/lbs/{name}/migrations/{migration_id}")
    async def migration_result(name: str, migration_id: str, wait_s: float = 10.0):
        m = plane.migration(migration_id)
        # Polled, not awaited through wrap_future: a timed-out wait must not cancel the migration.
        deadline = time.monotonic() + max(0.0, min(wait_s, 60.0))
        while not m.future.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if not m.future.done():
            return JSONResponse({"pending": True}, status_code=202)
        plane.migrations.pop(migration_id, None)
        return _result(m.future.result())

    @app.get("/v1/lbs/{name}/tokens")
    def tokens(name: str) -> dict:
        lb = plane.lb(name)
        return {"output_tokens": lb.metrics.output_tokens_total(), "counting_since": lb.metrics.counting_since}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(labelled_metrics(dict(plane.lbs)), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/shutdown")
    def shutdown() -> dict:
        threading.Thread(target=lambda: (plane.stop_all(), plane.on_empty()), daemon=True).start()
        return {"stopping": True}

    return app
