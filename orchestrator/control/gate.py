"""What every request to the daemon's API passes before FastAPI sees it (an ASGI middleware).

From the headers alone, before a byte of the body is read: the caller is identified
(orchestrator.control.auth; 401 for nobody, 403 for a replica or service credential on an
operator's route), then a declared body over the limit is refused (413). The body is then read
within a size limit and a time limit (413, 408) and, when it is JSON, checked for what Python's
parser accepts but JSON does not allow or cannot nest (NaN, Infinity, nesting deep enough to
exhaust the parser's recursion: 400). The caller is left in the request's state for the routes'
own scope checks. orchestrator.control.api wraps its app in it (`create_app`), and
`server_config` gives the daemon's uvicorn server its connection limits
(orchestrator.lb.limits: header and idle timeouts, a connection cap of its own).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import anyio.to_thread
import uvicorn

from orchestrator.control import auth
from orchestrator.lb import limits

MAX_BODY_BYTES = 2 << 20  # a spec (at most parse.MAX_SPEC_BYTES) in JSON, with room to spare
BODY_TIMEOUT_S = 30.0
# The control plane's own connection budget: a CLI, and each replica's notices and membership
# polls (short requests); far below what the process may open, so the daemon keeps working
# whatever the load balancers in the same process hold.
MAX_CONNECTIONS = 512
API_LIMITS = limits.Limits(max_body_bytes=MAX_BODY_BYTES, body_timeout_s=BODY_TIMEOUT_S,
                           max_connections=MAX_CONNECTIONS)

PUBLIC, BOOTSTRAP, REPLICA, OPERATOR = "public", "bootstrap", "replica", "operator"
_REPLICA_ROUTES = re.compile(r"^/v1/(notices|services/[^/]+/stores)$")


def route_kind(path: str) -> str:
    """Who may call `path`: anyone, a booting VM, a replica (or service, or the operator), or
    only the operator (every route not named here, including unknown ones)."""
    # The daemon's /metrics is the operator's (every service's fleet and $/hour: one service's
    # replica token must not read the others'); Prometheus scrapes it with the bearer token.
    if path == "/v1/health":
        return PUBLIC
    if path.startswith("/v1/bootstrap/"):
        return BOOTSTRAP
    return REPLICA if _REPLICA_ROUTES.match(path) else OPERATOR


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def json_problem(body: bytes) -> str | None:
    """Why a JSON body must be refused before FastAPI parses it, or None (malformed JSON is
    FastAPI's to report)."""
    try:
        json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        return "request body: JSON nested too deeply"
    except ValueError as err:
        if "is not valid JSON" in str(err):
            return f"request body: {err}"
    return None


class Gate:
    """The middleware. `operator_token` and `store` identify callers (auth.identify)."""

    def __init__(self, app, operator_token: Callable[[], str], store: Callable[[], object],
                 max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S):
        self.app = app
        self._token = operator_token
        self._store = store
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope["headers"]}
        kind = route_kind(scope["path"])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, credential = authorization.partition(" ")
        if kind == BOOTSTRAP and (scheme.lower() != "bootstrap" or not credential.strip()):
            return await _reply(send, 401, "missing bootstrap token (Authorization: Bootstrap <token>)")
        if kind in (REPLICA, OPERATOR):
            caller = await self._identify(credential.strip() if scheme.lower() == "bearer" else None)
            if caller is None:
                return await _reply(send, 401, "missing or wrong bearer token (see the token file in the "
                                               "state directory)")
            if kind == OPERATOR and caller.kind != auth.OPERATOR:
                return await _reply(send, 403, f"{caller.describe()} may not call {scope['path']}")
            scope.setdefault("state", {})["caller"] = caller
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await _reply(send, 413, f"request body over {self.max_body_bytes} bytes")
        try:
            body = await limits.read_body(receive, self.max_body_bytes, self.body_timeout_s)
        except limits.BodyTooLarge:
            return await _reply(send, 413, f"request body over {self.max_body_bytes} bytes")
        except TimeoutError:
            return await _reply(send, 408, f"request body not received within {self.body_timeout_s:.0f}s")
        except limits.ClientGone:
            return None
        if body and b"json" in headers.get(b"content-type", b""):
            problem = json_problem(body)
            if problem is not None:
                return await _reply(send, 400, problem)
        return await self.app(scope, _replay(body, receive), send)

    async def _identify(self, token: str | None) -> auth.Caller | None:
        if not token:
            return None
        operator = self._token()
        if auth.token_matches(token, operator):  # the common case: no store read, no thread
            return auth.Caller(auth.OPERATOR)
        return await anyio.to_thread.run_sync(auth.identify, token, operator, self._store())


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replayed


async def _reply(send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def server_config(app, host: str, port: int) -> uvicorn.Config:
    """The daemon API's uvicorn config: its own connection cap, header and idle timeouts."""
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", ws="none",
                          http=limits.protocol_class(limits.ConnectionGuard(API_LIMITS, name="daemon-api")),
                          timeout_keep_alive=int(API_LIMITS.idle_timeout_s))
