"""The data-plane process and its admin protocol, driven as the daemon drives it
(orchestrator.control.dataplane) over real HTTP, in front of fake vLLM upstream processes."""

from __future__ import annotations

import json
import os
import ssl
import stat
import threading

import httpx
import pytest
from tests.fakes.lb_client import Reader, ids_of, wait_for
from tests.helpers import alive, free_port

from orchestrator.common.errors import UserError
from orchestrator.control.dataplane import DataPlaneClient, RemoteBalancers
from orchestrator.lb.proxy import Upstream

pytestmark = pytest.mark.timeout(180)
STREAM = {"model": "fake", "prompt": "hello", "max_tokens": 40, "stream": True, "fake_token_delay": 0.05}


def record(home) -> dict:
    return json.loads((home / "dataplane.json").read_text())


def test_one_process_hosts_every_service_behind_a_private_token(state_home, fakes):
    balancers = RemoteBalancers()
    a = balancers.open("a", "127.0.0.1", free_port(), None, "least_load")
    b = balancers.open("b", "127.0.0.1", free_port(), None, "round_robin")
    a.set_replicas([Upstream("a-1", fakes[0].url)])
    b.set_replicas([Upstream("b-1", fakes[1].url)])
    for lb, name in ((a, "a"), (b, "b")):
        r = httpx.post(lb.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["system_fingerprint"] == name
    assert a.output_tokens()[0] == 3
    assert record(state_home)["pid"] == balancers.client.pid  # one process, both services
    token_file = state_home / "dataplane.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert httpx.get(record(state_home)["url"] + "/v1/lbs", timeout=10).status_code == 401
    assert httpx.get(record(state_home)["url"] + "/v1/lbs", timeout=10,
                     headers={"Authorization": "Bearer wrong"}).status_code == 401
    text = balancers.metrics_text().decode()
    assert 'spot_lb_output_tokens_total{service="a"} 3.0' in text and 'service="b"' in text
    with pytest.raises(UserError, match="url"):
        a.set_replicas([Upstream("a-2", "ftp://nowhere")])  # the LB's own one-line refusal
    # A second client (a restarted daemon) adopts the same LBs; opening one again keeps it.
    again = RemoteBalancers()
    again.adopt(["a"])  # b is no stored service: stopped
    kept = again.open("a", "127.0.0.1", int(a.url.rsplit(":", 1)[1]), None, "least_load")
    assert kept.url == a.url and again.client.pid == balancers.client.pid
    assert [row["name"] for row in again.client.call("GET", "/v1/lbs").json()] == ["a"]
    # A spec update's new LB policy applies to the running LB (same URL, same process).
    again.open("a", "127.0.0.1", int(a.url.rsplit(":", 1)[1]), None, "round_robin")
    assert [row["policy"] for row in again.client.call("GET", "/v1/lbs").json()] == ["round_robin"]
    # The last LB stopped: the process exits.
    pid = again.client.pid
    again.stop("a")
    wait_for(lambda: not alive(pid), 15, "the empty data plane to exit")
    assert not (state_home / "dataplane.json").exists()


def test_a_migration_is_held_for_the_daemons_hook_then_released(state_home, fakes):
    lb = RemoteBalancers().open("svc", "127.0.0.1", free_port(), None, "least_load")
    lb.set_replicas([Upstream("svc-1", fakes[0].url)])
    reader = Reader(lb.url, "/v1/completions", {**STREAM, "return_token_ids": True})
    wait_for(lambda: len(reader.chunks) >= 5, 30, "the stream under way")
    lb.set_replicas([Upstream("svc-1", fakes[0].url), Upstream("svc-2", fakes[1].url)])
    seen = []

    def hook() -> None:  # runs here, while the data plane holds the cut stream
        seen.append(len(reader.chunks))
        threading.Event().wait(0.5)
        seen.append(len(reader.chunks))

    result = lb.migrate("svc-1", resume_timeout=30, before_resume=hook).result(60)
    assert len(seen) == 2 and seen[0] == seen[1]  # nothing streamed while the hook ran
    assert result.requests == 1 and result.resumed == 1 and result.failed == 0
    reader.join(60)
    assert reader.done and not reader.error, reader
    assert len(ids_of(reader.chunks)) == 40  # every token, none twice


def test_a_daemon_that_never_releases_does_not_hold_the_streams(state_home, fakes):
    client = DataPlaneClient()
    lb = RemoteBalancers(client).open("svc", "127.0.0.1", free_port(), None, "least_load")
    lb.set_replicas([Upstream("svc-1", fakes[0].url)])
    reader = Reader(lb.url, "/v1/completions", {**STREAM, "return_token_ids": True})
    wait_for(lambda: len(reader.chunks) >= 5, 30, "the stream under way")
    lb.set_replicas([Upstream("svc-1", fakes[0].url), Upstream("svc-2", fakes[1].url)])
    started = client.call("POST", "/v1/lbs/svc/migrations",
                          json={"replica_id": "svc-1", "resume_timeout": 30, "hold_timeout": 1}).json()
    assert started["held"]
    # No release: the data plane lets the streams go on by itself after hold_timeout.
    result = wait_for(lambda: (lambda r: r.json() if r.status_code == 200 else None)(
        client.call("GET", f"/v1/lbs/svc/migrations/{started['id']}", params={"wait_s": 5})), 60, "the result")
    assert result["resumed"] == 1 and result["failed"] == 0
    reader.join(60)
    assert reader.done and len(ids_of(reader.chunks)) == 40, reader


def test_a_data_plane_found_dead_is_started_again_and_fed(state_home, fakes):
    balancers = RemoteBalancers()
    lb = balancers.open("svc", "127.0.0.1", free_port(), None, "least_load")
    lb.set_replicas([Upstream("svc-1", fakes[0].url)])
    first = balancers.client.pid
    os.kill(first, 9)
    wait_for(lambda: not alive(first), 10, "the data plane to die")
    balancers.check()  # what the daemon's probe job does
    assert balancers.client.pid != first and alive(balancers.client.pid)
    r = httpx.post(lb.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["system_fingerprint"] == "a"  # same port, same replicas


def test_tls_is_the_services_and_switching_it_restarts_only_that_lb(state_home, tmp_path, fakes):
    from tests.control.test_tls import self_signed

    certfile, keyfile = self_signed(tmp_path)
    balancers = RemoteBalancers()
    port = free_port()
    lb = balancers.open("svc", "127.0.0.1", port, None, "least_load")
    lb.set_replicas([Upstream("svc-1", fakes[0].url)])
    assert lb.url.startswith("http://")
    lb = balancers.open("svc", "127.0.0.1", port, (certfile, keyfile), "least_load")
    lb.set_replicas([Upstream("svc-1", fakes[0].url)])
    assert lb.url == f"https://127.0.0.1:{port}"
    r = httpx.post(lb.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=30,
                   verify=ssl.create_default_context(cafile=certfile))
    assert r.status_code == 200
    body = balancers.client.call("PUT", "/v1/lbs/svc", json={"port": port, "certfile": certfile,
                                                             "keyfile": keyfile}).json()
    assert body["started"] is False  # the same port and TLS: the running LB is kept
