"""The daemon's side of the data plane: find it, start it, adopt it, drive it over its admin API.

`RemoteBalancers` is the `Balancers` (orchestrator.control.balancers) that `serve()` uses: each
service's load balancer lives in the data-plane process (orchestrator.lb.dataplane), which a
daemon crash or upgrade does not end. On start the daemon adopts the running one (found by its
record, checked with its token) and keeps the LBs of stored services without restarting them;
a data plane found dead is started again and re-fed every LB and its last replica set.
A migration crosses the process boundary in phases (orchestrator.lb.admin): start (the LB
drains, cuts and holds the streams), the daemon's hook (the KV flush), release, result.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

import httpx

from orchestrator.common import paths, procs
from orchestrator.common.errors import RuntimeFailure, UserError
from orchestrator.lb import dataplane as plane
from orchestrator.lb.proxy import MigrationResult, Upstream

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
HOLD_TIMEOUT_S = 30.0  # the LB resumes the cut streams on its own if the daemon never releases them
_UNREACHABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectTimeout)


class DataPlaneDown(RuntimeFailure):
    """The data plane could not be reached or started."""


class DataPlaneClient:
    """The state directory's data-plane process: its admin URL and token, started when none
    answers. `on_restart` re-feeds a data plane that had to be started again."""

    def __init__(self, start_timeout_s: float = START_TIMEOUT_S):
        self.start_timeout_s = start_timeout_s
        self.url: str | None = None
        self.pid: int | None = None
        self.on_restart: Callable[[], None] = lambda: None
        self._http = httpx.Client(timeout=60)
        self._lock = threading.RLock()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {plane.load_or_create_token()}"}

    def running(self) -> bool:
        """Whether the recorded data plane runs and answers with our token (then it is used)."""
        record = plane.read_record()
        if not record or not procs.pid_alive(int(record.get("pid", 0))):
            return False
        try:
            r = self._http.get(record["url"] + "/v1/health", headers=self._headers(), timeout=5)
        except httpx.HTTPError:
            return False
        if r.status_code != 200:
            return False
        self.url, self.pid = record["url"], int(record["pid"])
        return True

    def ensure(self) -> bool:
        """Connect to the running data plane or start one; True when it was started now."""
        with self._lock:
            if self.running():
                log.info("adopting the data plane at %s (pid %s)", self.url, self.pid)
                return False
            self._start()
            return True

    def _start(self) -> None:
        record = plane.read_record()
        old = int((record or {}).get("pid", 0))
        if old and procs.pid_alive(old):  # exiting (its last LB stopped), or not answering: let it go
            _wait_gone(old, 10.0)
        log_path = paths.logs_dir() / "lb.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator.lb.dataplane"], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            record = plane.read_record()
            if record and record.get("pid") == proc.pid and self.running():
                log.info("data plane started at %s (pid %s)", self.url, self.pid)
                return
            if proc.poll() is not None:
                raise DataPlaneDown(f"the data plane exited ({proc.returncode}); see {log_path}")
            time.sleep(0.05)
        raise DataPlaneDown(f"the data plane did not start within {self.start_timeout_s:.0f}s; see {log_path}")

    def call(self, method: str, path: str, *, restart: bool = True, **kwargs) -> httpx.Response:
        """One admin request; a data plane that does not answer is started (and re-fed) first,
        once. Raises UserError with the data plane's message for a 4xx."""
        if self.url is None:
            self._connect(restart)
        try:
            r = self._http.request(method, self.url + path, headers=self._headers(), **kwargs)
            if r.status_code == 503:  # exiting: its last LB was stopped a moment ago
                raise httpx.ConnectError("the data plane is exiting")
        except _UNREACHABLE:
            if not restart:
                raise
            self._connect(True)
            r = self._http.request(method, self.url + path, headers=self._headers(), **kwargs)
        if 400 <= r.status_code < 500 and r.status_code not in (404,):
            raise UserError(_detail(r))
        return r

    def _connect(self, restart: bool) -> None:
        with self._lock:
            if self.url is not None and self.running():
                return
            if not restart:
                raise DataPlaneDown("no data plane runs")
            if self.ensure():
                self.on_restart()

    def stop(self) -> None:
        """End the data plane (its LBs stop first): SIGTERM, SIGKILL after 15 s."""
        record = plane.read_record()
        pid = int((record or {}).get("pid", 0))
        if pid and procs.pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            if not _wait_gone(pid, 15.0):
                os.kill(pid, signal.SIGKILL)
        self.url = None

    def close(self) -> None:
        self._http.close()


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while procs.pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _detail(r: httpx.Response) -> str:
    try:
        detail = r.json().get("detail")
    except ValueError:
        detail = None
    return str(detail or f"the data plane answered HTTP {r.status_code}")


class RemoteLB:
    """One service's load balancer in the data plane (a `ServiceBalancer`)."""

    def __init__(self, client: DataPlaneClient, name: str, url: str):
        self.client, self.name, self.url = client, name, url
        self._path = f"/v1/lbs/{name}"
        self.last_replicas: list[Upstream] = []

    def set_replicas(self, upstreams: Iterable[Upstream]) -> None:
        upstreams = list(upstreams)
        self.last_replicas = upstreams  # what a restarted data plane is fed again
        self.client.call("PUT", self._path + "/replicas", json=[_upstream(u) for u in upstreams])

    def drain(self, replica_ids: Iterable[str]) -> None:
        self.client.call("POST", self._path + "/drain", json={"replica_ids": list(replica_ids)})

    def output_tokens(self) -> tuple[int, float]:
        body = self.client.call("GET", self._path + "/tokens").json()
        return int(body["output_tokens"]), float(body["counting_since"])

    def migrate(self, replica_id: str, before_cut: Callable[[], object] | None = None,
                resume_timeout: float = 120.0, *,
                before_resume: Callable[[], object] | None = None) -> concurrent.futures.Future[MigrationResult]:
        """LoadBalancer.migrate across the process boundary; `before_resume` (a plain callable)
        runs here, between the cut and the release. `before_cut` runs in-process only."""
        if before_cut is not None:
            raise ValueError("before_cut is not supported by the data plane")
        future: concurrent.futures.Future[MigrationResult] = concurrent.futures.Future()
        threading.Thread(target=self._migrate, args=(future, replica_id, resume_timeout, before_resume),
                         daemon=True, name=f"migrate-{replica_id}").start()
        return future

    def _migrate(self, future, replica_id: str, resume_timeout: float, before_resume) -> None:
        try:
            started = self.client.call("POST", self._path + "/migrations", restart=False,
                                       json={"replica_id": replica_id, "resume_timeout": resume_timeout,
                                             "hold_timeout": HOLD_TIMEOUT_S}).json()
            path = f"{self._path}/migrations/{started['id']}"
            if started["held"]:
                try:
                    if before_resume is not None:
                        before_resume()
                except Exception:  # a failed flush costs a recompute, never the streams
                    log.exception("migration of %s: the hook failed; releasing the streams anyway", replica_id)
                finally:
                    self.client.call("POST", path + "/release", restart=False)
            deadline = time.monotonic() + resume_timeout + 60
            while True:
                r = self.client.call("GET", path, restart=False, params={"wait_s": 10})
                if r.status_code == 200:
                    body = r.json()
                    future.set_result(MigrationResult(**{**body, "continuation_ids": tuple(body["continuation_ids"])}))
                    return
                if r.status_code != 202 or time.monotonic() > deadline:
                    raise DataPlaneDown(f"migration of {replica_id}: {_detail(r)}")
        except Exception as err:
            future.set_exception(err)


def _upstream(u: Upstream) -> dict:
    return {"replica_id": u.replica_id, "url": u.url, "ready": u.ready, "draining": u.draining}


class RemoteBalancers:
    """Every service's load balancer in the data-plane process (a `Balancers`)."""

    def __init__(self, client: DataPlaneClient | None = None):
        self.client = client or DataPlaneClient()
        self.client.on_restart = self._refeed
        self.lbs: dict[str, RemoteLB] = {}
        self._configs: dict[str, dict] = {}

    def open(self, name: str, host: str, port: int, tls: tuple[str, str] | None, policy: str) -> RemoteLB:
        config = {"host": host, "port": port, "certfile": tls[0] if tls else None, "keyfile": tls[1] if tls else None,
                  "policy": policy}
        self._configs[name] = config
        body = self.client.call("PUT", f"/v1/lbs/{name}", json=config).json()
        log.info("service %s: load balancer %s at %s", name, "started" if body["started"] else "adopted",
                 body["url"])
        lb = self.lbs.get(name)
        if lb is None:
            lb = self.lbs[name] = RemoteLB(self.client, name, body["url"])
        lb.url = body["url"]
        return lb

    def adopt(self, names: Iterable[str]) -> None:
        if not self.client.running():
            return  # none runs: started when the first service's LB is opened
        wanted = set(names)
        for row in self.client.call("GET", "/v1/lbs").json():
            if row["name"] not in wanted:
                log.info("stopping the load balancer of %s: no such service in the store", row["name"])
                self.client.call("DELETE", f"/v1/lbs/{row['name']}")

    def stop(self, name: str) -> None:
        self._configs.pop(name, None)
        self.lbs.pop(name, None)
        try:
            self.client.call("DELETE", f"/v1/lbs/{name}", restart=False)
        except (httpx.HTTPError, DataPlaneDown):
            pass  # no data plane: nothing serves it

    def check(self) -> None:
        if self._configs and not self.client.running():
            log.warning("the data plane is gone: starting it again")
            self.client.url = None
            self.client.call("GET", "/v1/health")  # starts and re-feeds it

    def _refeed(self) -> None:
        """A data plane started again: every service's LB and its last replica set."""
        for name, config in list(self._configs.items()):
            try:
                self.client.call("PUT", f"/v1/lbs/{name}", restart=False, json=config)
                lb = self.lbs.get(name)
                if lb is not None:
                    lb.set_replicas(lb.last_replicas)
            except (httpx.HTTPError, UserError, DataPlaneDown) as err:
                log.error("service %s: its load balancer could not be started again: %s", name, err)

    def metrics_text(self) -> bytes:
        if not self._configs:
            return b""
        return self.client.call("GET", "/metrics", restart=False).content

    def shutdown(self) -> None:
        """The daemon exits: the data plane keeps serving (a new daemon adopts it)."""
        self.client.close()
