"""Hostile input against a live installation: one JSON line.

    .venv/bin/python tests/benchmarks/bench_hostile.py [--flood 20000] [--probes 200]

A daemon (its API server and jobs, in this process, as `spotctl daemon` runs them) serves two
services, alpha and beta, each one replica on the local cloud whose engine is the stand-in vLLM
(tests/fakes/upstream.py, streaming). A fixed set of hostile cases is sent to alpha's load
balancer and to the daemon's API: bad parameters streamed or not, bodies that are no JSON objects
or too large, malformed HTTP, YAML bombs, and every API route with beta's KV secret and replica
token. Printed: `cases`, `tracebacks` (logged in this process), `server_errors` (5xx the replica
did not send: the stand-in sends none unless asked), `cross_service_ok` (requests with beta's
credentials about alpha that succeeded), and the health checks' p99 (a new connection each, as a
prober makes) of the daemon and of alpha's LB, idle and while a child process holds `--flood`
idle connections to the LB open, opening again those the LB closes (`--flood-reopen-per-s`). The flood is scaled to what
one process may open (its hard open-file limit); `flood_connections` says what was held.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

class Tracebacks(logging.Handler):
    """Counts log records that carry a traceback, and uncaught thread exceptions."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0
        self.samples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.count += 1
            self.samples.append(record.getMessage()[:200])

    def thread_hook(self, args) -> None:
        self.count += 1
        self.samples.append(f"thread {args.thread.name}: {args.exc_value!r}"[:200])


def flood(port: int, count: int, seconds: float, ready: str, reopen_per_s: int) -> None:
    """Child process: hold `count` idle connections to 127.0.0.1:port for `seconds`, opening a new
    one for each the server closes (`reopen_per_s` a second, spread evenly)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sel = selectors.DefaultSelector()

    def open_one() -> bool:
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex(("127.0.0.1", port)) not in (0, 115):  # EINPROGRESS
            sock.close()
            return False
        sel.register(sock, selectors.EVENT_READ)
        return True

    opened = sum(open_one() for _ in range(count))
    Path(ready).write_text(str(opened))
    reopened, pending, last, deadline = 0, 0, time.monotonic(), time.monotonic() + seconds
    while time.monotonic() < deadline:
        closed = []
        for key, _ in sel.select(timeout=0.05):  # reopen steadily, not in bursts
            try:
                gone = key.fileobj.recv(1 << 16) == b""
            except OSError:
                gone = True
            if gone:
                closed.append(key.fileobj)
        for sock in closed:
            sel.unregister(sock)
            sock.close()
        pending += len(closed)
        now = time.monotonic()
        due = min(pending, int((now - last) * reopen_per_s))
        if due:
            reopened += sum(open_one() for _ in range(due))
            pending, last = pending - due, now
    Path(ready).write_text(json.dumps({"opened": opened, "reopened": reopened}))


def p99_ms(url: str, probes: int) -> float:
    """p99 of `probes` GETs, each on a new connection (as a prober makes them); 10 s for a failure."""
    host, port, path = url.removeprefix("http://").split("/", 1)[0].split(":") + ["/" + url.split("/", 3)[3]]
    times = []
    for _ in range(probes):
        started = time.perf_counter()
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", path)
            ok = conn.getresponse().status == 200
        except OSError:
            ok = False
        finally:
            conn.close()
        times.append((time.perf_counter() - started) * 1000 if ok else 10_000.0)
        time.sleep(0.01)
    times.sort()
    return times[min(len(times) - 1, int(len(times) * 0.99))]


def lb_cases() -> list[tuple[str, str, dict | bytes, dict]]:
    """(method, path, body, headers) sent to alpha's LB; none should get a 5xx."""
    bad_values = {
        "max_tokens": [0, -5, "x", 1.5, [], {}], "min_tokens": ["x", -1, [1]], "temperature": ["hot", -1, [0]],
        "stop": [5, [1, 2], {"a": 1}], "stream_options": ["x", 1, {"include_usage": "maybe"}], "seed": ["x", 1.5],
        "n": [0, "two"], "model": [7, ["a"]], "return_token_ids": ["perhaps"], "response_format": ["json"],
        "prompt": [{"a": 1}, [[-1]], 5], "max_completion_tokens": [0, "x"], "messages": ["hi", [1], [{"x": 1}]],
        "stream": ["sometimes", 2],
    }
    cases = []
    for path in ("/v1/completions", "/v1/chat/completions"):
        base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
        for field, values in bad_values.items():
            for value in values:
                for stream in (True, False):
                    cases.append(("POST", path, {"model": "x", "max_tokens": 4, **base, "stream": stream,
                                                 field: value}, {}))
        cases.append(("POST", path, {**base, "max_tokens": 3}, {}))  # no model: the replica's default
        cases.append(("POST", path, {**base, "max_tokens": 3, "stream": True}, {}))
        cases.append(("POST", path, {**base, "max_tokens": 5, "stream": True,
                                     "fake_stream_error": {"after": 2, "status": 400}}, {}))
        for raw in (b"", b"null", b"[]", b"not json", b'{"prompt": NaN}', b"[" * 200_000, b"\xff\xfe",
                    b'{"prompt": "' + b"x" * (20 << 20) + b'"}'):
            cases.append(("POST", path, raw, {"Content-Type": "application/json"}))
    cases += [("GET", "/v1/models", b"", {}), ("PUT", "/v1/completions", b"{}", {}), ("GET", "/nope", b"", {})]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flood", type=int, default=20_000, help="idle connections to hold open")
    parser.add_argument("--flood-seconds", type=float, default=40.0)
    parser.add_argument("--flood-reopen-per-s", type=int, default=1000,
                        help="connections the flood opens again per second in place of those the LB closed")
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--flood-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood_child:
        port, count, ready = args.flood_child
        return flood(int(port), int(count), args.flood_seconds, ready, args.flood_reopen_per_s)

    home = tempfile.mkdtemp(prefix="bench-hostile-")
    os.environ["SPOT_ORCHESTRATOR_HOME"] = home
    os.environ.setdefault("SPOT_ORCHESTRATOR_MODELS", str(Path(home) / "models"))
    counter = Tracebacks()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().addHandler(counter)
    threading.excepthook = counter.thread_hook

    import httpx

    from orchestrator.control import auth
    from orchestrator.control.api import create_app
    from orchestrator.control.launch import kv_secret_file
    from tests.fakes.standin import SPEC, services_running

    with services_running(Path(home), ("alpha", "beta")) as (daemon, operator, replicas):
        endpoints = {name: operator.get(f"/v1/services/{name}").json()["endpoint"] for name in replicas}
        beta = {"kv": kv_secret_file("beta").read_text().strip(),
                "replica": auth.replica_token_for(daemon.store.get_replica(replicas["beta"]["replica_id"]))}
        results = {"cases": 0, "server_errors": 0, "cross_service_ok": 0}
        errors: list[str] = []

        def record(what: str, status: int, cross: bool = False) -> None:
            results["cases"] += 1
            if status >= 500:
                results["server_errors"] += 1
                errors.append(f"{what}: {status}")
            if cross and status < 400:
                results["cross_service_ok"] += 1
                errors.append(f"cross-service {what}: {status}")

        lb = httpx.Client(base_url=endpoints["alpha"], timeout=60)
        for method, path, body, headers in lb_cases():
            kwargs = {"json": body} if isinstance(body, dict) else {"content": body}
            try:
                resp = lb.request(method, path, headers=headers, **kwargs)
                status = resp.status_code
                if status < 500 and "event-stream" in resp.headers.get("content-type", ""):
                    for line in resp.text.splitlines():
                        if line.startswith("data: {") and '"error"' in line:
                            status = max(status, json.loads(line[6:])["error"]["code"])
            except httpx.HTTPError as err:
                status = 599
                errors.append(f"{method} {path}: {err!r}")
            record(f"LB {method} {path}", status)
        for raw in (b"\x16\x03\x01garbage\r\n\r\n", b"GET /health HTTP/1.1\r\nX: " + b"y" * (80 << 10) + b"\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n{"):
            host, port = endpoints["alpha"].removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=20) as sock:
                sock.sendall(raw)
                answer = sock.recv(4096)
            record("LB raw HTTP", int(answer.split(b" ")[1]) if answer.startswith(b"HTTP/1.1 ") else 599)

        # The daemon's API: every route about alpha with beta's credentials, with none, with junk.
        app = create_app(daemon)
        from fastapi.routing import APIRoute

        api = httpx.Client(base_url=daemon.url, timeout=60)
        samples = {"/v1/services": {"yaml": SPEC.format(name="alpha")},
                   "/v1/notices": {"instance_id": replicas["alpha"]["instance_id"], "deadline": time.time() + 60},
                   "/v1/chaos/preempt": {"replica_id": replicas["alpha"]["replica_id"], "grace_s": 60},
                   "/v1/bootstrap/redeem": {"instance_id": replicas["alpha"]["instance_id"], "version": "0"}}
        for route in app.routes:
            if not isinstance(route, APIRoute) or route.path == "/v1/health":
                continue
            for method in route.methods:
                path = route.path.replace("{name}", "alpha")
                body = samples.get(route.path) if method == "POST" else None
                for token in (beta["kv"], beta["replica"], "junk", None, f"Bootstrap {beta['kv']}"):
                    auth_header = {} if token is None else {
                        "Authorization": token if token.startswith("Bootstrap") else f"Bearer {token}"}
                    resp = api.request(method, path, json=body, headers=auth_header)
                    record(f"API {method} {path}", resp.status_code, cross=True)
        bombs = [SPEC.format(name="bomb") + "config:\n  a: &a [" + ",".join(['"lol"'] * 9) + "]\n" + "".join(
            f"  {c}: &{c} [" + ",".join([f"*{p}"] * 9) + "]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)),
            "/etc/passwd", "x" * (1 << 21), "[" * 10_000, "name: x\nengine: {model: tiny}\nenvs: {A: .nan}",
            "name: x\nengine: {model: tiny}\nservice: {replicas: 10000000}", "a: !!binary aGk=",
            "name: x\nengine: {model: tiny}\nservice: {replicas: " + "9" * 5000 + "}"]
        for text in bombs:
            record("API spec", operator.post("/v1/services", json={"yaml": text}).status_code)
        for raw in (b'{"yaml": NaN}', b"[" * 100_000, b"{" * 10, b'{"yaml": "x", "envs": {"A=B": "1"}}'):
            record("API body", operator.post("/v1/services", content=raw,
                                             headers={"Content-Type": "application/json"}).status_code)
        for params in ({"service": "nosuch"}, {"limit": -1}, {"limit": 10**30}, {"since": "nan"}):
            record("API events", operator.get("/v1/events", params=params).status_code)
        with socket.create_connection(daemon.url.removeprefix("http://").split(":"), timeout=20) as sock:
            sock.sendall(b"POST /v1/services HTTP/1.1\r\nHost: x\r\nContent-Length: 200000000\r\n\r\n{")
            answer = sock.recv(4096)
        record("API 200 MB unauthenticated", int(answer.split(b" ")[1]))

        # Health, idle and under the flood.
        lb_health, api_health = endpoints["alpha"] + "/health", daemon.url + "/v1/health"
        idle = {"lb": p99_ms(lb_health, args.probes), "daemon": p99_ms(api_health, args.probes)}
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        count = min(args.flood, hard - 64)
        ready = Path(home) / "flood.json"
        port = int(endpoints["alpha"].rsplit(":", 1)[1])
        child = subprocess.Popen([sys.executable, __file__, "--flood-seconds", str(args.flood_seconds),
                                  "--flood-reopen-per-s", str(args.flood_reopen_per_s),
                                  "--flood-child", str(port), str(count), str(ready)])
        while not ready.exists() and child.poll() is None:
            time.sleep(0.2)
        time.sleep(5.0)  # the opening burst is over: now the flood is held
        guard = daemon.lbs["alpha"].guard
        flooded = {"lb": p99_ms(lb_health, args.probes), "daemon": p99_ms(api_health, args.probes)}
        held_by_lb = len(guard)
        child.wait(timeout=args.flood_seconds + 60)
        flood_stats = json.loads(ready.read_text())
        after = operator.get("/v1/services/alpha").json()
        alive = [r["state"] for r in after["replicas"]] == ["READY"]
    out = {
        "cases": results["cases"], "tracebacks": counter.count, "server_errors": results["server_errors"],
        "cross_service_ok": results["cross_service_ok"],
        "health_p99_ms_idle": {k: round(v, 2) for k, v in idle.items()},
        "health_p99_ms_under_flood": {k: round(v, 2) for k, v in flooded.items()},
        "flood_ratio": {k: round(flooded[k] / max(idle[k], 0.01), 2) for k in idle},
        "flood_connections": flood_stats["opened"], "flood_requested": args.flood, "fd_hard_limit": hard,
        "flood_reopened": flood_stats["reopened"], "flood_reopen_per_s": args.flood_reopen_per_s,
        "lb_connections_held": held_by_lb,
        "lb_connection_cap": guard.limits.max_connections, "lb_evicted": guard.evicted,
        "lb_refused": guard.refused, "alpha_still_ready": alive, "errors": errors[:5], "traceback_samples":
            counter.samples[:3],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
