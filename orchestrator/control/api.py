"""The daemon's HTTP API (FastAPI). Every route but /v1/health and /v1/bootstrap/* needs a bearer
credential, checked before the body is read (orchestrator.control.gate): the operator's token for
every route; a replica's own token (or, for membership only, its service's KV secret) for the two
replica routes, and then only for its own service and, for notices, its own instance.

Routes (JSON in and out; errors are {"detail": "<one line>"}):
    GET    /v1/health                   {"status": "ok", "role": "leader", ...} (a standby daemon's
                                         answers "standby": orchestrator.control.standby)
    GET    /metrics                     Prometheus text (orchestrator.control.metrics); the operator's
    POST   /v1/services                 {"yaml": "<service YAML>", "name": optional, "update_mode":
                                         "rolling" (default) | "blue-green"}
    GET    /v1/services                 services with their replicas
    GET    /v1/services/{name}
    DELETE /v1/services/{name}          start `down` (poll GET until 404)
    GET    /v1/services/{name}/stores   the KV shard stores of the service's live replicas
    GET    /v1/services/{name}/logs     where each replica's log is (the CLI reads them)
    GET    /v1/events                   ?service=&limit=&since=
    GET    /v1/cost, /v1/cost/{name}    what each service (or one) has cost (orchestrator.control.costing)
    POST   /v1/notices                  {"instance_id", "kind", "deadline", "source"} (agents)
    POST   /v1/chaos/preempt            {"replica_id" | "zone", "grace_s"}
    GET    /v1/orphans                  machines no known service (incarnation) owns; the grace runs
    DELETE /v1/orphans                  terminate them now (`spotctl down --all`)
    GET    /v1/bootstrap/wheel, POST /v1/bootstrap/redeem      (a booting VM, with its bootstrap token)
Errors are {"detail": "<one line>"}: 400/422 for bad input, 401/403 for credentials, 404, 413.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestrator.common import identity
from orchestrator.control import auth, kvtls
from orchestrator.control.gate import Gate
from orchestrator.common.errors import UserError
from orchestrator.fleet.lifecycle import ReplicaState, is_alive
from orchestrator.control.bootstrap import BootstrapError
from orchestrator.control.launch import kv_secret_file
from orchestrator.control.metrics import CONTENT_TYPE
from orchestrator.control.wheel import own_wheel
from orchestrator.control.wheel import version as wheel_version
from orchestrator.spec import ServiceSpec, load_spec_text, spec_from_json
from orchestrator.spec.revision import launch_revision
from orchestrator.control.store import ReplicaRow, ServiceRow
from policies.base import DEFAULT_POLICY
from providers.base import Notice, NoticeKind


log = logging.getLogger(__name__)

NOTICE_HORIZON_S = 86400.0  # no cloud warns a day ahead; a later deadline is a mistake or an attack
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")  # the spec's service names
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Body(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)


class ServiceUp(_Body):
    yaml: str = Field(min_length=1)
    name: str | None = None
    # Values for the spec's `envs` (`spotctl up --env K=V`, or the user's environment).
    envs: dict[str, str] = Field(default_factory=dict)
    # How replicas of changed launch fields are replaced (orchestrator.fleet.rollout).
    update_mode: Literal["rolling", "blue-green"] = "rolling"


class BootstrapRedeem(_Body):
    instance_id: str = Field(min_length=1)
    version: str = Field(min_length=1)  # the replica runtime's: it must be the daemon's


class NoticeIn(_Body):
    instance_id: str = Field(min_length=1, max_length=256)
    kind: NoticeKind = NoticeKind.PREEMPT
    deadline: float = Field(ge=0)
    source: str = Field(default="agent", max_length=64)

    @field_validator("deadline")
    @classmethod
    def _within_a_day(cls, value: float) -> float:
        if value > time.time() + NOTICE_HORIZON_S:
            raise ValueError("more than a day ahead")
        return value


class ChaosPreempt(_Body):
    replica_id: str | None = None
    zone: str | None = None
    service: str | None = None
    grace_s: float = Field(default=30.0, ge=0, le=NOTICE_HORIZON_S)


def replica_json(r: ReplicaRow) -> dict[str, Any]:
    return {
        "replica_id": r.replica_id,
        "service": r.service,
        "state": r.state,
        "cloud": r.cloud,
        "region": r.region,
        "zone": r.zone,
        "market": r.market,
        "instance_id": r.instance_id,
        "instance_type": r.instance_type,
        "endpoint": r.endpoint,
        "agent_endpoint": r.agent_endpoint,
        "control_endpoint": r.control_endpoint,
        "price_per_hour": r.price_per_hour,
        "launched_at": r.launched_at,
        "ready_at": r.ready_at,
        "notice_deadline": r.notice_deadline,
        "status_message": r.status_message,
        "spec_revision": r.spec_revision,
    }


def with_envs(spec: ServiceSpec, values: dict[str, str]) -> ServiceSpec:
    """The spec with its `envs` filled from `values`; raises UserError naming an env that the
    spec leaves empty (null) and no value fills."""
    envs = dict(spec.task.get("envs") or {})
    for key, value in values.items():
        if not _ENV_NAME.match(key) or "\0" in value:
            raise UserError(f"envs: {key[:64]!r} is not a variable name (letters, digits, '_') with a value")
    envs.update(values)  # a K the spec does not list is added, as SkyPilot does
    missing = sorted(k for k, v in envs.items() if v is None)
    if missing:
        raise UserError(f"envs.{missing[0]}: no value; pass `spotctl up --env {missing[0]}=...` "
                        "or set it in the environment of `spotctl up`")
    if not envs:
        return spec
    return spec_from_json(json.dumps({**spec.to_dict(), "envs": envs}))


def resolved_policy_name(name: str) -> str:
    return f"{DEFAULT_POLICY} (default)" if name in ("default", DEFAULT_POLICY) else name


def service_json(row: ServiceRow, replicas: list[ReplicaRow]) -> dict[str, Any]:
    spec = spec_from_json(row.spec_json)
    return {
        "name": row.name,
        "status": row.status,
        "endpoint": row.endpoint,
        "replicas_ready": sum(1 for r in replicas if r.state == ReplicaState.READY.value),
        "replicas_total": sum(1 for r in replicas),
        "uptime_s": time.time() - row.created_at,
        "created_at": row.created_at,
        "policy": resolved_policy_name(spec.service.placement_policy),
        "load_balancing_policy": spec.service.load_balancing_policy,
        "resources": spec.to_dict().get("resources", {}),
        "update": update_json(row, spec, replicas),
        "replicas": [replica_json(r) for r in replicas],
    }


def update_json(row: ServiceRow, spec: ServiceSpec, replicas: list[ReplicaRow]) -> dict[str, Any]:
    """The update's progress: live replicas of the current launch revision and of older ones."""
    revision = launch_revision(spec)
    live = [r for r in replicas if is_alive(r.replica_state)]
    old = sum(1 for r in live if r.spec_revision != revision)
    return {"in_progress": row.update_mode is not None, "mode": row.update_mode, "revision": revision,
            "old": old, "new": len(live) - old}


def create_app(daemon) -> FastAPI:  # daemon: orchestrator.control.daemon.Daemon (no import cycle)
    app = FastAPI(title="spot-orchestrator daemon", docs_url=None, redoc_url=None)

    app.add_middleware(Gate, operator_token=lambda: daemon.token, store=lambda: daemon.store)

    def caller(request: Request) -> auth.Caller:
        return request.state.caller  # set by the gate on every route that needs a credential

    @app.exception_handler(UserError)
    async def user_error(_: Request, err: UserError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return JSONResponse({"detail": f"{where}: {first.get('msg')}"}, status_code=422)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        log.exception("API request failed")
        return JSONResponse({"detail": f"internal error ({type(err).__name__}); see the daemon's log"},
                            status_code=500)

    @app.get("/v1/health")
    def health() -> dict:
        return {"status": "ok", "role": "leader", "pid": __import__("os").getpid(), "started_at": daemon.started_at}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(daemon.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/services")
    def up(body: ServiceUp) -> dict:
        spec = load_spec_text(body.yaml)
        if body.name:
            spec = spec_from_json(json.dumps({**spec.to_dict(), "name": body.name}))
        return daemon.apply_spec(with_envs(spec, body.envs), body.update_mode)

    def bootstrap_token(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        return header[10:].strip() if header.lower().startswith("bootstrap ") else None

    @app.get("/v1/bootstrap/wheel")
    def bootstrap_wheel(request: Request) -> FileResponse:
        """The daemon's own wheel, for a booting VM holding an unused bootstrap token."""
        try:
            daemon.bootstrap.check(bootstrap_token(request))
        except BootstrapError as err:
            raise HTTPException(err.status, str(err)) from None
        path = own_wheel()
        return FileResponse(path, filename=path.name, media_type="application/octet-stream")

    @app.post("/v1/bootstrap/redeem")
    def bootstrap_redeem(body: BootstrapRedeem, request: Request) -> dict:
        """A booting VM's secrets, once: the service's KV secret, its shard store's TLS files
        (kvtls), and the spec's environment with the replica's own token in it."""
        if body.version != wheel_version():
            raise HTTPException(409, f"replica runtime {body.version} is not the daemon's {wheel_version()}")
        try:
            redeemed = daemon.bootstrap.redeem(bootstrap_token(request), body.instance_id)
        except BootstrapError as err:
            raise HTTPException(err.status, str(err)) from None
        row = get_row(redeemed.service)
        replica = daemon.store.get_replica(redeemed.replica_id)
        if replica is None:
            raise HTTPException(401, "the replica of this token is gone")
        envs = spec_from_json(row.spec_json).task.get("envs") or {}
        env = {str(k): str(v) for k, v in envs.items() if v is not None}
        env[identity.REPLICA_TOKEN_ENV] = auth.replica_token_for(replica)
        return {"service": redeemed.service, "replica_id": redeemed.replica_id,
                "kv_secret": kv_secret_file(redeemed.service).read_text().strip(),
                "kv_tls": kvtls.issue(redeemed.service, redeemed.replica_id)._asdict(), "env": env}

    @app.get("/v1/services")
    def services() -> list[dict]:
        return [
            service_json(row, daemon.store.list_replicas(row.name, include_terminal=True))
            for row in daemon.store.list_services()
        ]

    def get_row(name: str) -> ServiceRow:
        row = daemon.store.get_service(name) if _NAME.match(name) else None
        if row is None:
            raise HTTPException(404, f"no service named {name!r}")
        return row

    @app.get("/v1/services/{name}")
    def service(name: str) -> dict:
        row = get_row(name)
        return service_json(row, daemon.store.list_replicas(name, include_terminal=True))

    @app.delete("/v1/services/{name}")
    def down(name: str) -> dict:
        get_row(name)
        daemon.down(name)
        return {"name": name, "status": "SHUTTING_DOWN"}

    @app.get("/v1/services/{name}/stores")
    def stores(name: str, request: Request) -> dict:
        who = caller(request)
        if not who.may_use(name):  # before the lookup: another service's names are not told either
            raise HTTPException(403, f"{who.describe()} may not read the stores of service {name!r}")
        get_row(name)
        live = [
            r
            for r in daemon.store.list_replicas(name)
            if r.agent_endpoint and r.state not in (ReplicaState.SHUTTING_DOWN.value,)
        ]
        return {
            "stores": [
                {"node_id": r.replica_id, "endpoint": r.agent_endpoint, "cloud": r.cloud, "region": r.region,
                 "zone": r.zone}
                for r in live
            ]
        }

    @app.get("/v1/services/{name}/logs")
    def logs(name: str) -> dict:
        get_row(name)
        out = []
        for r in daemon.store.list_replicas(name, include_terminal=True):
            provider = daemon.providers.get(r.cloud)
            path = provider.log_path(r.instance_id) if provider is not None and r.instance_id else None
            out.append({"replica_id": r.replica_id, "state": r.state, "log_path": str(path) if path else None})
        return {"replicas": out}

    @app.get("/v1/events")
    def events(service: str | None = None, limit: int = Query(100, ge=1, le=10000),
               since: float | None = Query(None, allow_inf_nan=False)) -> list[dict]:
        rows = daemon.store.list_events(service=service, since=since, limit=limit)
        if service is not None and not rows:
            get_row(service)  # no events, and no such service either: 404
        return [
            {"id": e.id, "at": e.at, "service": e.service, "replica_id": e.replica_id, "kind": e.kind,
             "zone": e.zone, "market": e.market, "message": e.message}
            for e in rows
        ]

    @app.get("/v1/cost")
    def costs() -> list[dict]:
        out = []
        for row in daemon.store.list_services():
            try:
                out.append(daemon.cost(row.name).as_dict())
            except UserError:  # deleted since it was listed (`down` finished)
                continue
        return out

    @app.get("/v1/cost/{name}")
    def cost(name: str) -> dict:
        get_row(name)
        return daemon.cost(name).as_dict()

    @app.post("/v1/notices")
    def notice(body: NoticeIn, request: Request) -> dict:
        who = caller(request)
        if who.kind == auth.SERVICE:
            raise HTTPException(403, "a notice needs the replica's own token, not its service's KV secret")
        if who.kind == auth.REPLICA and (who.instance_id is None or body.instance_id != who.instance_id):
            raise HTTPException(403, f"{who.describe()} may only report notices for its own instance")
        handled = daemon.migrator.on_notice(
            Notice(instance_id=body.instance_id, kind=body.kind, deadline=body.deadline, source=body.source)
        )
        return {"accepted": True, "replica_id": handled}

    @app.get("/v1/orphans")
    def list_orphans() -> list[dict]:
        return daemon.sweep_orphans()

    @app.delete("/v1/orphans")
    def terminate_orphans() -> list[dict]:
        return daemon.sweep_orphans(now_all=True)

    @app.post("/v1/chaos/preempt")
    def chaos(body: ChaosPreempt) -> dict:
        if bool(body.replica_id) == bool(body.zone):
            raise UserError("chaos preempt: give exactly one of a replica id or --zone")
        return {"preempted": daemon.migrator.chaos_preempt(body.replica_id, body.zone, body.grace_s, body.service)}

    return app
