"""One service cannot touch another through the daemon's API, and the API refuses what it must
before it reads a body: two live services (stand-in engines, real local-cloud processes, the real
API server), and every route tried with the other service's KV secret and replica token."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

from orchestrator.common import identity
from orchestrator.control import auth
from orchestrator.control.api import create_app
from orchestrator.control.launch import kv_secret_file
from tests.fakes.standin import SPEC, services_running

@pytest.fixture(scope="module")
def two_services(tmp_path_factory):
    with services_running(tmp_path_factory.mktemp("iso-home"), ("alpha", "beta")) as (d, client, replicas):
        creds = {name: {"kv": kv_secret_file(name).read_text().strip(),
                        "replica": auth.replica_token_for(d.store.get_replica(replicas[name]["replica_id"]))}
                 for name in replicas}
        yield d, client, replicas, creds


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def sample_request(path: str, method: str, replicas: dict) -> dict:
    """A well-formed request for each route, about service alpha."""
    path = path.replace("{name}", "alpha")
    body = {
        "/v1/services": {"yaml": SPEC.format(name="alpha")},
        "/v1/notices": {"instance_id": replicas["alpha"]["instance_id"], "deadline": time.time() + 60},
        "/v1/chaos/preempt": {"replica_id": replicas["alpha"]["replica_id"], "grace_s": 60},
        "/v1/bootstrap/redeem": {"instance_id": replicas["alpha"]["instance_id"], "version": "0"},
    }.get(path)
    return {"method": method, "url": path, **({"json": body} if body is not None and method == "POST" else {})}


def routes(d) -> list[tuple[str, str]]:
    app = create_app(d)
    return [(r.path, m) for r in app.routes if isinstance(r, APIRoute) for m in sorted(r.methods)]


def test_every_route_refuses_the_other_services_credentials(two_services):
    d, client, replicas, creds = two_services
    anyone = httpx.Client(base_url=d.url, timeout=30)
    tried = 0
    for path, method in routes(d):
        if path in ("/v1/health",):
            continue
        request = sample_request(path, method, replicas)
        for kind in ("kv", "replica"):
            r = anyone.request(**request, headers=bearer(creds["beta"][kind]))
            tried += 1
            assert r.status_code in (401, 403), (kind, method, path, r.status_code, r.text)
            assert "detail" in r.json()
        r = anyone.request(**request)  # no credential at all
        assert r.status_code == 401, (method, path, r.status_code)
    assert tried >= 20
    # Nothing happened to alpha: its replica still serves, and no notice was recorded for it.
    svc = client.get("/v1/services/alpha").json()
    assert [r["state"] for r in svc["replicas"]] == ["READY"]
    assert not [e for e in client.get("/v1/events", params={"service": "alpha"}).json() if e["kind"] == "notice"]


def test_each_credential_works_in_its_own_scope_only(two_services):
    d, client, replicas, creds = two_services
    own = httpx.Client(base_url=d.url, timeout=30)
    # Membership: own service with its KV secret or a replica token; never the other one.
    for kind in ("kv", "replica"):
        assert own.get("/v1/services/beta/stores", headers=bearer(creds["beta"][kind])).status_code == 200
        assert own.get("/v1/services/alpha/stores", headers=bearer(creds["beta"][kind])).status_code == 403
        assert own.get("/v1/services/nosuch/stores", headers=bearer(creds["beta"][kind])).status_code == 403
    # Notices: only with the replica's own token, only for its own instance.
    notice = {"instance_id": replicas["beta"]["instance_id"], "deadline": time.time() + 600, "source": "test"}
    assert own.post("/v1/notices", json=notice, headers=bearer(creds["beta"]["kv"])).status_code == 403
    assert own.post("/v1/notices", json={**notice, "instance_id": replicas["alpha"]["instance_id"]},
                    headers=bearer(creds["beta"]["replica"])).status_code == 403
    # Operator routes are the operator's.
    for kind in ("kv", "replica"):
        assert own.get("/v1/services", headers=bearer(creds["beta"][kind])).status_code == 403
        assert own.get("/v1/services/beta", headers=bearer(creds["beta"][kind])).status_code == 403
    # A forged replica token (right shape, other service's id, or a changed MAC) names nobody.
    claim = identity.parse(creds["beta"]["replica"])
    forged = [creds["beta"]["replica"].replace(claim.replica_id, replicas["alpha"]["replica_id"]),
              creds["beta"]["replica"].replace(".beta.", ".alpha."), creds["beta"]["replica"][:-2] + "xx"]
    for token in forged:
        assert own.get("/v1/services/alpha/stores", headers=bearer(token)).status_code == 401
    # The one notice that is allowed: beta's replica about itself.
    r = own.post("/v1/notices", json=notice, headers=bearer(creds["beta"]["replica"]))
    assert r.status_code == 200 and r.json()["replica_id"] == replicas["beta"]["replica_id"]
    assert client.get("/v1/services/alpha").json()["replicas"][0]["state"] == "READY"


def raw_request(url: str, head: str, body: bytes = b"", wait: float = 10.0) -> tuple[bytes, float]:
    """Send `head` (+ `body`) on a raw socket; the answer's first bytes and how long it took."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        started = time.monotonic()
        sock.sendall(head.encode() + body)
        answer = sock.recv(4096)
        return answer, time.monotonic() - started


def test_unauthenticated_or_oversized_bodies_are_refused_unread(two_services):
    d, *_ = two_services
    # 200 MB announced, 10 bytes sent: the answer comes at once, without the daemon waiting for the rest.
    head = ("POST /v1/services HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 200000000\r\n\r\n")
    answer, _ = raw_request(d.url, head, b'{"yaml": "')
    assert answer.startswith(b"HTTP/1.1 401")
    answer, _ = raw_request(d.url, head.replace("Host: x", f"Host: x\r\nAuthorization: Bearer {d.token}"), b"{")
    assert answer.startswith(b"HTTP/1.1 413")
    # Chunked, no length announced: counted while read.
    client = httpx.Client(base_url=d.url, headers=bearer(d.token), timeout=60)

    def chunks():
        for _ in range(40):
            yield b" " * (128 << 10)

    r = client.post("/v1/services", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


@pytest.mark.parametrize("body, status", [
    (b'{"yaml": "name: x", "envs": {"A": NaN}}', 400),
    (b"[" * 50000 + b"]" * 50000, 400),
    (b'{"instance_id": "i", "deadline": 1e999}', 422),
])
def test_json_python_accepts_but_json_forbids_is_400(two_services, body, status):
    d, *_ = two_services
    path = "/v1/notices" if b"deadline" in body else "/v1/services"
    r = httpx.post(d.url + path, content=body, headers={**bearer(d.token), "Content-Type": "application/json"})
    assert r.status_code == status and "detail" in r.json()


def test_events_of_an_unknown_service_is_404_and_state_files_are_private(two_services):
    d, client, *_ = two_services
    assert client.get("/v1/events", params={"service": "nosuch"}).status_code == 404
    assert client.get("/v1/events", params={"service": "alpha"}).status_code == 200
    assert client.get("/v1/events", params={"limit": -1}).status_code == 422
    home = Path(d.store.engine.url.database).parent
    assert home.stat().st_mode & 0o777 == 0o700
    for path in [home / "state.db", home / "token", *(home / "logs").glob("*.log"), *(home / "services").rglob("*")]:
        if path.is_file():
            assert path.stat().st_mode & 0o077 == 0, path


def test_a_booting_vm_redeems_its_replicas_own_token_once(two_services):
    from orchestrator.control.wheel import version

    d, _client, replicas, creds = two_services
    alpha = replicas["alpha"]
    token = d.bootstrap.issue("alpha", alpha["replica_id"])
    body = {"instance_id": alpha["instance_id"], "version": version()}
    r = httpx.post(d.url + "/v1/bootstrap/redeem", json=body, headers={"Authorization": f"Bootstrap {token}"})
    assert r.status_code == 200, r.text
    granted = r.json()
    replica_token = granted["env"][identity.REPLICA_TOKEN_ENV]
    assert identity.parse(replica_token).replica_id == alpha["replica_id"]
    assert granted["kv_secret"] != creds["beta"]["kv"]
    assert httpx.get(d.url + "/v1/services/alpha/stores", headers=bearer(replica_token)).status_code == 200
    assert httpx.get(d.url + "/v1/services/beta/stores", headers=bearer(replica_token)).status_code == 403
    again = httpx.post(d.url + "/v1/bootstrap/redeem", json=body, headers={"Authorization": f"Bootstrap {token}"})
    assert again.status_code == 401
