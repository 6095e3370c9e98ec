"""OpenAI-compatible load balancer in front of one service's vLLM replicas.

The data plane (orchestrator.lb.dataplane; or the daemon itself, in-process) runs one per
service; the daemon tells it the replica set (`set_replicas`), and its migrator
drains and migrates replicas on notices (`drain`, `migrate`). It routes every `/v1/...` call to a
ready replica (least_load or round_robin), retries a try that reaches no replica elsewhere (3
tries, as SkyServe), and continues a broken or migrated stream on another replica token for token
(orchestrator.lb.continuation; docs/preemption.md). Serves `/health` and Prometheus `/metrics`
(with the output tokens served, which `spotctl cost` divides by).
Every request it cannot serve gets an OpenAI-shaped 4xx (orchestrator.lb.validate, lb.limits;
docs/hostile-input.md), every 503 a Retry-After. A client's X-Request-Id (one is made when it sent
none) goes to the replica and comes back on the answer; each /v1/ request's latency by status
and a stream's time to its first event go to the metrics (orchestrator.lb.metrics).
Raw ASGI on purpose: the hop has a budget of about a millisecond. It runs on its own event loop;
`set_replicas`, `in_flight` and `migrate` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import uvicorn

from orchestrator.lb.continuation import (
    CHAT,
    COMPLETIONS,
    SEAM_ID_HEADER,
    Mode,
    SeamMismatch,
    Splice,
    UpstreamStreamError,
    new_seam_id,
    plan_stream,
)
from orchestrator.common.errors import UserError
from orchestrator.lb import limits as lb_limits
from orchestrator.lb.limits import Limits
from orchestrator.lb.metrics import LBMetrics, completion_tokens
from orchestrator.lb.picking import make_picker
from orchestrator.lb.server import CoalescingHTTPProtocol
from orchestrator.lb.upstream import UpstreamError, UpstreamPool
from orchestrator.lb.sse import SSE_DONE, SSESplitter, sse_event
from orchestrator.lb.validate import BadRequest, parse_request, upstream_error

log = logging.getLogger(__name__)

MAX_TRIES = 3  # tries of one request (or of one continuation) that reach no replica
MAX_SEAMS = 16  # continuations of one stream; beyond that something is wrong everywhere
# A try that failed before the replica said anything: safe to send elsewhere.
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                   ConnectionError, asyncio.TimeoutError)
# A stream that broke after it began (replica killed, connection reset, cut by migrate()).
_STREAM_ERRORS = (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError, UpstreamStreamError,
                  json.JSONDecodeError)
# A kept-alive connection the replica closes just as a request goes out on it fails with
# ServerDisconnectedError before any answer. aiohttp resends only idempotent methods on a fresh
# connection (RFC 9112 section 9.3.1); our POSTs are resent too, this many times, before the try
# counts against the replica: the replica closed an idle connection, it did not fail. (A dead
# replica refuses the fresh connection, and that counts at once.)
STALE_RESENDS = 2
_JSON = b"application/json"
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
# A client's X-Request-Id is passed on when it is short printable ASCII and does not pose as
# a continuation's (the migrator counts KV records by those); otherwise the LB makes one.
_CLIENT_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")
_REQUEST_ID_KEY = "spot.request_id"  # where _proxy leaves the id in the ASGI scope for app()


@dataclass(frozen=True)
class Upstream:
    """A replica as the daemon tells the LB about it."""

    replica_id: str
    url: str
    ready: bool = True
    draining: bool = False

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining


@dataclass(frozen=True)
class MigrationResult:
    replica_id: str
    requests: int  # in flight on the replica when it was cut
    resumed: int  # of those, continued elsewhere (first token after the seam, or completed)
    failed: int  # ended with an error or did not resume within the timeout
    # The X-Request-Id of each continuation sent for these requests (vLLM puts it into its own
    # request id, so the replicas' KV records of the continuations can be told apart).
    continuation_ids: tuple[str, ...] = ()


class _Handle:
    """One client request as migrate() and the disconnect watcher see it."""

    __slots__ = ("client_gone", "continuable", "cut", "done", "gate", "replica", "resumed", "seam_ids", "splice",
                 "task", "waiting")

    def __init__(self, task: asyncio.Task):
        self.task = task
        self.continuable = True  # False: a stream migrate() leaves on its replica until it ends or dies
        self.replica: str | None = None
        self.waiting = False  # awaiting its replica: the only time a cut may cancel the task
        self.cut = False
        self.client_gone = False
        self.done = False
        self.resumed: asyncio.Future | None = None
        self.gate: asyncio.Future | None = None  # a cut stream's continuation waits for it
        self.splice: Splice | None = None  # a continuable stream's tokens so far
        self.seam_ids: list[str] = []  # X-Request-Id of each continuation request sent for it

    def absorb_cut(self) -> bool:
        """On CancelledError: True when migrate() cut this request (the task goes on), False
        when it is a real cancellation (the client left, the server stops) to re-raise."""
        if not self.cut or self.client_gone:
            return False
        self.task.uncancel()
        return True

    def settle(self, ok: bool) -> None:
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(ok)


_error_body = lb_limits.error_body
_CLOSE = [(b"connection", b"close")]  # after a body left unread


async def _send_json(send, status: int, body: bytes, content_type: bytes = _JSON, extra: list | None = None) -> None:
    headers = [(b"content-type", content_type)] + (extra or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send, status: int, message: str, kind: str = "server_error", extra: list | None = None,
                      param: str | None = None) -> None:
    body = _error_body(status, message, kind)
    if param is not None:
        body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()
    await _send_json(send, status, body, extra=extra)


def _answer_headers(headers: list, status: int, request_id: bytes | None) -> list:
    """An answer's headers with its X-Request-Id and, on a 503, Retry-After (a new list: the
    constant header lists are shared)."""
    if request_id is not None:
        headers = [*headers, (b"x-request-id", request_id)]
    if status == 503:
        headers = [*headers, lb_limits.RETRY_AFTER]
    return headers


def _validate(upstream: Upstream) -> Upstream:
    parts = urlsplit(upstream.url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"replica {upstream.replica_id}: url {upstream.url!r} is not an http(s)://host:port URL")
    return dataclasses.replace(upstream, url=upstream.url.rstrip("/"))


class LoadBalancer:
    """One service's endpoint. `app` is the ASGI app; `start()` serves it in a thread."""

    def __init__(self, policy: str = "least_load", *, connect_timeout: float = 5.0,
                 stream_idle_timeout: float | None = 600.0, limits: Limits | None = None):
        self._picker = make_picker(policy)
        self.limits = limits or Limits.from_env()
        self._streams = lb_limits.StreamSlots(self.limits.max_streams_per_client)
        self.guard: lb_limits.ConnectionGuard | None = None  # its connections, once it serves
        self.policy = policy
        self._replicas: dict[str, Upstream] = {}
        # Replicas drain() took out for good: a replica set published from a view older than
        # the notice (a probe pass racing it) must not send them new requests or continuations.
        self._drained: set[str] = set()
        self._replicas_lock = threading.Lock()  # set_replicas (daemon threads) vs drain()
        self._in_flight: dict[str, int] = {}
        self._handles: dict[str, set[_Handle]] = {}
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout,
                                              sock_read=stream_idle_timeout)
        self.metrics = LBMetrics(self._in_flight_series)
        self._session: aiohttp.ClientSession | None = None  # streams (and HEAD)
        self._pool: UpstreamPool | None = None  # every other non-streamed request
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    # -- the daemon's side ----------------------------------------------------------------------
    def set_replicas(self, upstreams: Iterable[Upstream]) -> None:
        """Replace the replica set. Draining or not-ready replicas get no new requests; requests
        already on a replica that left the set go on until they end or it dies. Raises UserError
        for a replica URL that is not http(s)://host:port."""
        replicas = {u.replica_id: _validate(u) for u in upstreams}
        with self._replicas_lock:
            self._drained &= replicas.keys()  # ids are never reused: one that left is gone
            for replica_id in self._drained:
                replicas[replica_id] = dataclasses.replace(replicas[replica_id], draining=True)
            departed = self._replicas.keys() - replicas.keys()
            self._replicas = replicas  # one assignment: readers on the loop see old or new, never half
        self.metrics.forget(departed)

    def set_policy(self, policy: str) -> None:
        """Pick replicas by another policy from the next request on (a spec update, in place)."""
        self._picker, self.policy = make_picker(policy), policy

    def drain(self, replica_ids: Iterable[str]) -> None:
        """No new request, retry or continuation goes to these replicas from now on (thread-safe,
        idempotent, sticky across set_replicas). What they serve goes on until migrate() cuts it."""
        with self._replicas_lock:
            replicas = dict(self._replicas)
            for replica_id in replica_ids:
                self._drained.add(replica_id)
                if replica_id in replicas:
                    replicas[replica_id] = dataclasses.replace(replicas[replica_id], draining=True)
            self._replicas = replicas

    def replicas(self) -> list[Upstream]:
        return list(self._replicas.values())

    def output_tokens(self) -> tuple[int, float]:
        """(output tokens served, since when): what `spotctl cost` divides by."""
        return self.metrics.output_tokens_total(), self.metrics.counting_since

    def _in_flight_series(self) -> dict[str, int]:
        """The in-flight gauge at scrape time: a replica that left the set is shown only while
        requests still finish on it (its idle zero stays in the dict, not in the scrape)."""
        replicas = self._replicas
        return {r: n for r, n in list(self._in_flight.items()) if n or r in replicas}

    def in_flight(self, replica_id: str) -> int:
        return self._in_flight.get(replica_id, 0)

    def streamed_tokens(self, replica_id: str) -> list[int]:
        """How many tokens each continuable stream now on `replica_id` has generated (what a
        migration of it would carry over); readable from any thread."""
        handles = list(self._handles.get(replica_id, ()))  # one C-level copy: safe beside the loop
        return [len(h.splice.generated) for h in handles if h.splice is not None and not h.done]

    def migrate(self, replica_id: str, before_cut: Callable[[], object] | None = None,
                resume_timeout: float = 120.0, *,
                before_resume: Callable[[], object] | None = None) -> concurrent.futures.Future[MigrationResult]:
        """Continue every request in flight on `replica_id` elsewhere (thread-safe).

        The replica is marked draining at once; `before_cut` (a coroutine function, or a plain
        callable run in a worker thread) is awaited before its upstream streams are cut, and
        `before_resume` (same kinds) after the cut and before any cut stream is continued:
        the place for the KV flush, since by then every token a client has was generated and
        its block handed to the replica's saver. The future resolves once every cut request
        has resumed elsewhere or failed. From async code: `await asyncio.wrap_future(...)`.
        Raises RuntimeError before the load balancer serves (`start`).
        """
        if self._loop is None:
            raise RuntimeError("the load balancer is not serving yet")
        return asyncio.run_coroutine_threadsafe(
            self.migrate_async(replica_id, before_cut, resume_timeout, before_resume=before_resume), self._loop)

    async def migrate_async(self, replica_id: str, before_cut: Callable[[], object] | None = None,
                            resume_timeout: float = 120.0, *,
                            before_resume: Callable[[], object] | None = None) -> MigrationResult:
        """migrate() on the LB's own loop."""
        self.drain([replica_id])
        if before_cut is not None:
            await _call(before_cut)
        loop = asyncio.get_running_loop()
        handles = [h for h in self._handles.get(replica_id, ()) if h.continuable and not h.done]
        gate = loop.create_future() if before_resume is not None and handles else None
        for handle in handles:
            handle.resumed = loop.create_future()
            handle.cut = True
            handle.gate = gate
            if handle.waiting:
                handle.task.cancel()
        if gate is not None:
            try:
                await _call(before_resume)
            except Exception:  # a failed flush costs a recompute, never the streams
                log.exception("migrate(%s): before_resume failed; continuing the streams anyway", replica_id)
            finally:
                gate.set_result(None)
        sent_before = [len(h.seam_ids) for h in handles]
        futures = [h.resumed for h in handles]
        if futures:
            await asyncio.wait(futures, timeout=resume_timeout)
        resumed = sum(1 for f in futures if f.done() and f.result())
        ids = tuple(sid for h, n in zip(handles, sent_before, strict=True) for sid in h.seam_ids[n:])
        return MigrationResult(replica_id, len(handles), resumed, len(handles) - resumed, ids)

    # -- running it -----------------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0, tls: tuple[str, str] | None = None) -> int:
        """Serve in a background thread (its own event loop); returns the port. `tls`
        (certfile, keyfile): serve HTTPS. Raises UserError when it cannot listen on host:port,
        RuntimeError when it already runs or did not start."""
        if self._thread is not None:
            raise RuntimeError("the load balancer is already running")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            sock.close()
            raise UserError(f"load balancer: cannot listen on {host}:{port}: {err.strerror}") from None
        port = sock.getsockname()[1]
        self.guard = lb_limits.ConnectionGuard(self.limits, f"lb-{port}", lb_limits.process_budget())
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on", loop="none",
                                http=lb_limits.protocol_class(self.guard, CoalescingHTTPProtocol), interface="asgi3",
                                proxy_headers=False, ws="none", timeout_graceful_shutdown=5,
                                timeout_keep_alive=max(1, round(self.limits.idle_timeout_s)),
                                backlog=min(4096, self.limits.max_connections),
                                ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, args=(sock,), name=f"lb-{port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"load balancer on {host}:{port} did not start")
            time.sleep(0.01)
        self.url = f"{'https' if tls else 'http'}://{host}:{port}"
        log.info("load balancer listening on %s (policy %s)", self.url, self.policy)
        return port

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        if self.guard is not None:
            self.guard.close()
        self._server = self._thread = None

    def _serve(self, sock: socket.socket) -> None:
        loop = _new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._server.serve(sockets=[sock]))
        finally:
            loop.run_until_complete(self._close_session())
            loop.close()
            sock.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created on first use so that the app works without lifespan too
            self._loop = asyncio.get_running_loop()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                timeout=self._timeout, auto_decompress=False, skip_auto_headers=("User-Agent",))
            self._pool = UpstreamPool(self._timeout.sock_connect or 5.0, self._timeout.sock_read)
        return self._session

    async def _close_session(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- ASGI -----------------------------------------------------------------------------------
    async def app(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan(receive, send)
        if kind != "http":
            return
        arrived = time.perf_counter()
        status = 0  # the answer's, once its headers went out
        first_event = False  # a stream whose first event is still to be sent

        async def tracked(message) -> None:
            nonlocal status, first_event
            if message["type"] == "http.response.start":
                status = message["status"]
                first_event = message["headers"] is _SSE_HEADERS
                message["headers"] = _answer_headers(message["headers"], status, scope.get(_REQUEST_ID_KEY))
            elif first_event and message.get("body"):
                first_event = False
                self.metrics.ttft_seconds.observe(time.perf_counter() - arrived)
            await send(message)

        try:
            await self._http(scope, receive, tracked)
        except Exception:  # a bug: say so in the log, and in OpenAI's shape to the client
            log.exception("load balancer: %s %s failed", scope.get("method"), scope.get("path"))
            if not status:
                await _send_error(tracked, 500, "internal error in the load balancer", extra=_CLOSE)
        finally:
            # Client traffic only (not /health or /metrics); a client gone before any answer has no status.
            if status and scope["path"].startswith("/v1/"):
                self.metrics.observe_request(status, time.perf_counter() - arrived)

    async def _http(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        if path.startswith("/v1/"):
            return await self._proxy(scope, receive, send, path, method)
        if path == "/health":
            ready = sum(1 for u in self._replicas.values() if u.routable)
            body = json.dumps({"status": "ok" if ready else "no ready replica", "ready_replicas": ready,
                               "replicas": len(self._replicas)}).encode()
            return await _send_json(send, 200 if ready else 503, body)
        if path == "/metrics":
            return await _send_json(send, 200, self.metrics.render(), b"text/plain; version=0.0.4")
        await _send_error(send, 404, f"no route {method} {path}", "not_found_error")

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._client()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._close_session()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _watch_disconnect(self, receive, handle: _Handle) -> None:
        # uvicorn's send() is silent once the client is gone, so only receive() tells us.
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if not handle.done:
            handle.client_gone = True
            handle.task.cancel()

    async def _proxy(self, scope, receive, send, path: str, method: str) -> None:
        headers = {"Content-Type": "application/json"}
        declared = None
        request_id = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                headers["Authorization"] = value.decode("latin-1")
            elif name == b"content-length":
                declared = value
            elif name == b"x-request-id":
                request_id = value
        if request_id is None or b"seam-" in request_id or not _CLIENT_REQUEST_ID.fullmatch(request_id):
            request_id = os.urandom(16).hex().encode()
        scope[_REQUEST_ID_KEY] = request_id
        headers[SEAM_ID_HEADER] = request_id.decode("latin-1")  # a continuation's seam id replaces it
        limit = self.limits.max_body_bytes
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _send_error(send, 413, f"request body over {limit} bytes", "invalid_request_error", _CLOSE)
        try:
            raw = await lb_limits.read_body(receive, limit, self.limits.body_timeout_s)
        except lb_limits.ClientGone:
            return
        except lb_limits.BodyTooLarge:
            return await _send_error(send, 413, f"request body over {limit} bytes", "invalid_request_error", _CLOSE)
        except TimeoutError:
            return await _send_error(send, 408, f"request body not received within {self.limits.body_timeout_s:g}s",
                                     "invalid_request_error", _CLOSE)
        body = None
        if method == "POST" and path in (COMPLETIONS, CHAT):
            try:
                body = parse_request(path, raw)
            except BadRequest as err:
                return await _send_error(send, 400, str(err), "invalid_request_error", param=err.param)
        client = None
        if body is not None and body.get("stream"):
            client = (scope.get("client") or ("",))[0]
            if not self._streams.acquire(client):
                self.metrics.errors.labels("", "client_stream_limit").inc()
                return await _send_error(send, 429, f"more than {self.limits.max_streams_per_client} concurrent "
                                                    "streams from this client", "rate_limit_error")
        handle = _Handle(asyncio.current_task())
        watcher = asyncio.ensure_future(self._watch_disconnect(receive, handle))
        try:
            if client is not None:
                plan = plan_stream(path, body)
                if plan.mode is Mode.NONE:
                    handle.continuable = False
                    await self._stream_passthrough(path, raw, headers, send, handle)
                else:
                    splice = Splice(plan)
                    try:
                        await self._stream_spliced(splice, headers, send, handle)
                    finally:  # every token the client got, across seams, counted once
                        self.metrics.output_tokens.inc(len(splice.generated))
            else:
                query = scope.get("query_string") or b""
                target = path + ("?" + query.decode("latin-1") if query else "")
                await self._unary(method, target, raw, headers, send, handle, usage=body is not None)
        except asyncio.CancelledError:
            if not handle.client_gone:
                raise
        finally:
            if client is not None:
                self._streams.release(client)
            handle.done = True
            handle.settle(False)  # a migrate() waiting on a request whose client left
            watcher.cancel()

    # -- replicas and in-flight accounting ------------------------------------------------------
    def _choose(self, excluded: set[str]) -> Upstream | None:
        replicas = self._replicas
        candidates = [r for r, u in replicas.items() if u.routable and r not in excluded]
        if not candidates:
            return None
        return replicas[self._picker.pick(candidates, self._in_flight)]

    def _acquire(self, replica: str, handle: _Handle) -> None:
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        self._handles.setdefault(replica, set()).add(handle)
        handle.replica = replica
        self.metrics.count_request(replica)

    def _release(self, replica: str, handle: _Handle) -> None:
        count = self._in_flight.get(replica, 0)
        if count <= 0:
            self.metrics.accounting_errors.inc()
            log.error("in-flight count of %s would go negative", replica)
        elif count == 1 and replica not in self._replicas:
            del self._in_flight[replica]  # a replica that left the set: forget it once idle
        else:
            self._in_flight[replica] = count - 1
        handles = self._handles.get(replica)
        if handles is not None:
            handles.discard(handle)
            if not handles:
                del self._handles[replica]
        handle.replica = None

    def _no_replica(self, tries: int) -> tuple[int, str]:
        if tries == 0:
            self.metrics.errors.labels("", "no_ready_replica").inc()
            return 503, "no ready replica for this service; try again shortly"
        self.metrics.errors.labels("", "all_tries_failed").inc()
        return 502, f"no replica could be reached after {tries} tries"

    async def _refuse(self, send, handle: _Handle, tries: int) -> None:
        """Answer 503 (no ready replica) or 502 (every try failed) before any byte was sent."""
        handle.settle(False)
        status, message = self._no_replica(tries)
        await _send_error(send, status, message)

    def _try_failed(self, replica: str, kind: str, tries: int) -> bool:
        """Count a failed try; True when another try is allowed."""
        self.metrics.errors.labels(replica, kind).inc()
        if tries < MAX_TRIES:
            self.metrics.retries.labels(kind).inc()
            return True
        return False

    def _answer_failed(self, replica: str, status: int, excluded: set[str], tries: int) -> bool:
        """A replica's own 5xx before any byte reached the client: the replica failed, not the
        request (vLLM answers bad input with a 4xx): an engine that died under it, an
        overloaded one. Leaves that replica out; True when another one may be asked."""
        excluded.add(replica)
        return self._try_failed(replica, f"http_{status}", tries)

    async def _no_more_tries(self, send, handle: _Handle, tries: int, failed: tuple | None) -> None:
        """No replica left to ask: the last replica's own 5xx answer (`failed`: status, body,
        content type) is the client's, else a 503 / 502 of ours."""
        if failed is None:
            return await self._refuse(send, handle, tries)
        handle.settle(False)
        handle.done = True
        await _send_json(send, *failed)

    # -- non-streamed requests ------------------------------------------------------------------
    async def _unary(self, method: str, target: str, raw: bytes, headers: dict, send, handle: _Handle,
                     usage: bool = False) -> None:
        """Send the request as is; a failed or cut try is repeated from scratch elsewhere, which
        gives the same answer for greedy and seeded requests alike (nothing reached the client).
        `usage`: a completion, whose answer's output tokens are counted."""
        session, pool = self._client(), self._pool
        excluded: set[str] = set()
        tries = 0
        failed: tuple[int, bytes, bytes] | None = None  # the last replica's own 5xx answer
        while True:
            upstream = self._choose(excluded)
            if upstream is None:
                return await self._no_more_tries(send, handle, tries, failed)
            replica = upstream.replica_id
            self._acquire(replica, handle)
            handle.waiting = True
            try:
                if method == "HEAD" or not upstream.url.startswith("http://"):  # HEAD: no body; TLS: aiohttp
                    async with await _request(session, method, upstream.url + target, raw, headers) as resp:
                        payload = await resp.read()
                        status = resp.status
                        content_type = resp.headers.get("Content-Type", "application/json").encode("latin-1")
                else:
                    status, payload, content_type = await pool.request(upstream.url, method, target, raw, headers)
            except _CONNECT_ERRORS + _STREAM_ERRORS + (UpstreamError,):
                excluded.add(replica)
                tries += 1
                if self._try_failed(replica, "connect", tries):
                    continue
                return await self._refuse(send, handle, tries)
            except asyncio.CancelledError:
                if not handle.absorb_cut():
                    raise
                handle.cut = False
                excluded.add(replica)
                self.metrics.migrations.labels("cut", "restart").inc()
                continue
            finally:
                handle.waiting = False
                self._release(replica, handle)
            if status >= 500:  # nothing reached the client: another replica is asked
                tries += 1
                failed = (status, payload, content_type)
                if self._answer_failed(replica, status, excluded, tries):
                    continue
                return await self._no_more_tries(send, handle, tries, failed)
            if usage and status == 200:
                self.metrics.output_tokens.inc(completion_tokens(payload) or 0)
            handle.settle(True)
            handle.done = True
            return await _send_json(send, status, payload, content_type)

    # -- streams that cannot be continued -------------------------------------------------------
    async def _stream_passthrough(self, path: str, raw: bytes, headers: dict, send, handle: _Handle) -> None:
        session = self._client()
        excluded: set[str] = set()
        tries = 0
        started = False
        failed: tuple[int, bytes, bytes] | None = None  # the last replica's own 5xx answer
        while True:
            upstream = self._choose(excluded)
            if upstream is None:
                return await self._no_more_tries(send, handle, tries, failed)
            replica = upstream.replica_id
            self._acquire(replica, handle)
            handle.waiting = True
            try:
                async with await _request(session, "POST", upstream.url + path, raw, headers) as resp:
                    if resp.status != 200:
                        payload = await resp.read()
                        if resp.status >= 500:  # before the first byte: another replica is asked
                            tries += 1
                            failed = (resp.status, payload, _JSON)
                            if self._answer_failed(replica, resp.status, excluded, tries):
                                continue
                            return await self._no_more_tries(send, handle, tries, failed)
                        handle.done = True
                        return await _send_json(send, resp.status, payload)
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                    started = True
                    produced = 0  # known only when the client asked for usage (stream_options)
                    async for chunk in resp.content.iter_any():
                        handle.waiting = False
                        produced = completion_tokens(chunk) or produced
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        handle.waiting = True
                self.metrics.output_tokens.inc(produced)
                handle.done = True
                handle.settle(True)
                return await send({"type": "http.response.body", "body": b""})
            except _CONNECT_ERRORS + _STREAM_ERRORS as err:
                log.debug("try on %s failed: %s", replica, err)
                if not started:  # nothing reached the client yet: try another replica
                    excluded.add(replica)
                    tries += 1
                    if self._try_failed(replica, "connect", tries):
                        continue
                    return await self._refuse(send, handle, tries)
                reason = "broken"
            except asyncio.CancelledError:
                if not handle.absorb_cut():
                    raise
                reason = "cut"
            finally:
                handle.waiting = False
                self._release(replica, handle)
            # Mid-stream, and the request is not one a continuation can reproduce.
            self.metrics.errors.labels(replica, reason).inc()
            self.metrics.continuation_failures.labels("not_continuable").inc()
            handle.settle(False)
            return await self._end_with_error(send, "the replica serving this stream went away and the "
                                                    "request cannot be continued (n>1, logprobs, echo or tools)")

    async def _end_with_error(self, send, message: str, status: int = 502) -> None:
        event = sse_event(_error_body(status, message, "server_error"))
        await send({"type": "http.response.body", "body": event + SSE_DONE})

    # -- streams continued across replicas ------------------------------------------------------
    async def _stream_spliced(self, splice: Splice, headers: dict, send, handle: _Handle) -> None:
        handle.splice = splice
        session = self._client()
        excluded: set[str] = set()
        tries = 0  # failed tries since the last one that made progress
        started = False  # the client has its response headers
        last_token_at: float | None = None
        seam_reason = "broken"
        upstream_status = 502  # a replica's own 5xx, when that is how the last try failed
        failed: tuple[int, bytes, bytes] | None = None  # a replica's own 5xx before the first byte
        while True:
            if splice.budget_spent():
                events = splice.finish_locally()
                await send({"type": "http.response.body", "body": b"".join(events) + SSE_DONE})
                handle.settle(True)
                return
            if splice.segments > MAX_SEAMS or not splice.continuable():
                break
            path, body, mode = splice.next_request()
            upstream = self._choose(excluded)
            if upstream is None:
                if not started:
                    return await self._no_more_tries(send, handle, tries, failed)
                break
            replica = upstream.replica_id
            sent_headers = headers
            if splice.segments > 1:  # after a seam: vLLM takes the id into its own request id
                handle.seam_ids.append(new_seam_id())
                sent_headers = {**headers, SEAM_ID_HEADER: handle.seam_ids[-1]}
            if mode is not None:
                self.metrics.migrations.labels(seam_reason, mode.value).inc()
                self.metrics.migrated_tokens.inc(len(splice.generated))
                if mode is Mode.REPLAY:
                    self.metrics.replayed_tokens.inc(len(splice.generated))
            self._acquire(replica, handle)
            handle.waiting = True
            progressed = False
            failure: str | None = None
            refusal: tuple[int, bytes] | None = None  # a replica's 4xx: the client's to see, not to retry
            resp = None
            try:
                resp = await _request(session, "POST", upstream.url + path, json.dumps(body).encode(), sent_headers)
                if resp.status != 200:
                    payload = await resp.read()
                    if not started and resp.status >= 500:  # nothing reached the client: ask another
                        tries += 1
                        failed = (resp.status, payload, _JSON)
                        if self._answer_failed(replica, resp.status, excluded, tries):
                            continue
                        return await self._no_more_tries(send, handle, tries, failed)
                    if not started:
                        handle.done = True
                        handle.settle(False)
                        return await _send_json(send, resp.status, payload)
                    failure = f"http_{resp.status}"
                    status, payload = upstream_error(_error_of(payload, resp.status))
                    if status < 500:
                        refusal = (status, payload)
                    upstream_status = status
                else:
                    if not started:
                        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                        started = True
                    splitter = SSESplitter()
                    async for chunk in resp.content.iter_any():
                        handle.waiting = False
                        for data in splitter.feed(chunk):
                            events, new_tokens = splice.on_data(data)
                            if new_tokens:
                                now = time.monotonic()
                                if splice.tokens_at_seam is not None:
                                    if last_token_at is not None:
                                        self.metrics.stall_seconds.observe(now - last_token_at)
                                    splice.tokens_at_seam = None
                                    handle.settle(True)
                                last_token_at = now
                                progressed = True
                            if events:
                                await send({"type": "http.response.body", "body": b"".join(events),
                                            "more_body": True})
                            if splice.finished or handle.cut:  # a cut drops what is buffered:
                                break  # the continuation regenerates it
                        if splice.finished or handle.cut:
                            break
                        handle.waiting = True
                        # aiohttp hands out buffered data without yielding: let migrate() (whose
                        # cut lands here) and other streams run between two reads.
                        await asyncio.sleep(0)
                    if not splice.finished:
                        failure = "cut" if handle.cut else "eof"
            except UpstreamStreamError as err:  # the replica said why inside its stream
                failure = "upstream_error"
                status, payload = upstream_error(err.error)
                if status < 500:
                    refusal = (status, payload)
                upstream_status = status
            except _CONNECT_ERRORS + _STREAM_ERRORS as err:
                log.debug("try on %s failed: %s", replica, err)
                failure = "connect" if resp is None else "broken"
            except SeamMismatch as err:
                log.warning("replay diverged, resuming from token ids instead: %s", err)
                self.metrics.continuation_failures.labels("replay_mismatch").inc()
                splice.replay_diverged()
                failure = "replay_mismatch"
            except asyncio.CancelledError:
                if not handle.absorb_cut():
                    raise
                failure = "cut"
            finally:
                handle.waiting = False
                self._release(replica, handle)
                if resp is not None:
                    # A replica that finished sends [DONE] next: read it and keep the connection.
                    # Otherwise (stop string matched here, a cut, a break) drop the connection,
                    # which also aborts the request on the replica.
                    if splice.finished and not splice.stop.stops and await _drained(resp):
                        resp.release()
                    else:
                        resp.close()
            if splice.finished:
                handle.done = True
                handle.settle(True)
                return await send({"type": "http.response.body", "body": SSE_DONE})
            if refusal is not None:
                self.metrics.errors.labels(replica, f"http_{refusal[0]}").inc()
                handle.done = True
                handle.settle(False)
                return await send({"type": "http.response.body", "body": sse_event(refusal[1]) + SSE_DONE})
            # A seam: this segment ended before the stream did.
            if handle.cut:  # a cut, even when the replica broke the stream at the same moment
                failure = "cut"
            if failure == "cut":
                handle.cut = False
                if handle.gate is not None:  # e.g. the cut replica's KV flush
                    gate, handle.gate = handle.gate, None
                    await gate
            seam_reason = "cut" if failure == "cut" else "broken"
            self.metrics.errors.labels(replica, failure).inc()
            excluded = {replica} if progressed else excluded | {replica}
            tries = 0 if progressed or failure == "cut" else tries + 1
            if tries >= MAX_TRIES:
                break
            if tries:
                self.metrics.retries.labels(failure).inc()
            splice.begin_seam()
        # Out of replicas or tries in the middle of a stream.
        self.metrics.continuation_failures.labels("no_replica").inc()
        handle.settle(False)
        if not started:
            return await self._refuse(send, handle, max(tries, 1))
        await self._end_with_error(send, "the stream could not be continued on any replica", upstream_status)


def _error_of(payload: bytes, status: int) -> object:
    """The `error` object of a replica's error answer, or one made from its status."""
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError, RecursionError):
        error = None
    if isinstance(error, dict):
        return {**error, "code": status}
    return {"message": str(error or payload[:200].decode("utf-8", "replace")), "code": status}


async def _request(session: aiohttp.ClientSession, method: str, url: str, data: bytes,
                   headers: dict) -> aiohttp.ClientResponse:
    """session.request(), resent on a fresh connection when a kept-alive one was closed under it."""
    for _ in range(STALE_RESENDS):
        try:
            return await session.request(method, url, data=data, headers=headers)
        except aiohttp.ServerDisconnectedError:
            log.debug("%s %s: the kept-alive connection was closed before an answer; resending", method, url)
    return await session.request(method, url, data=data, headers=headers)


async def _call(hook: Callable[[], object]) -> None:
    """Await a hook: a coroutine function, or a plain callable run in a worker thread."""
    if inspect.iscoroutinefunction(hook):
        await hook()
        return
    result = await asyncio.to_thread(hook)
    if inspect.isawaitable(result):
        await result


async def _drained(resp: aiohttp.ClientResponse) -> bool:
    try:
        while await resp.content.readany():
            pass
    except _STREAM_ERRORS:
        return False
    return True


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # optional speed-up
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve_forever(lb: LoadBalancer, host: str, port: int) -> None:  # pragma: no cover - convenience
    """Run `lb` in the foreground until interrupted (for scripts and benchmarks)."""
    lb.start(host, port)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        lb.stop()


__all__ = ["LoadBalancer", "MigrationResult", "Upstream", "serve_forever"]
