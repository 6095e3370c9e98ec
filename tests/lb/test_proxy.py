"""The load balancer over real HTTP: fake vLLM upstreams run as their own processes."""

from __future__ import annotations

import json
import socket
import socketserver
import threading

import httpx
import openai
import pytest
from tests.fakes.lb_client import metric, wait_for
from tests.fakes.upstream import FakeProcess

from orchestrator.common.errors import UserError
from orchestrator.lb.proxy import LoadBalancer, Upstream

pytestmark = pytest.mark.timeout(120)


def dead_url() -> str:
    """A port with nothing listening (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def make_lb():
    started = []

    def make(policy: str = "least_load", replicas=()) -> LoadBalancer:
        lb = LoadBalancer(policy)
        lb.start()
        lb.set_replicas(replicas)
        started.append(lb)
        return lb

    yield make
    for lb in started:
        lb.stop()


def complete(lb: LoadBalancer, **extra) -> httpx.Response:
    body = {"model": "fake", "prompt": "hello", "max_tokens": 4, **extra}
    return httpx.post(lb.url + "/v1/completions", json=body, timeout=30)


def served_by(response: httpx.Response) -> str:
    return response.json()["system_fingerprint"]


class LongStream:
    """A slow streamed request held open in a thread until close()."""

    def __init__(self, lb: LoadBalancer):
        self.client = httpx.Client(timeout=30)
        self.chunks = 0
        self.fingerprint = None
        self._stop = threading.Event()
        body = {"model": "fake", "prompt": "long", "max_tokens": 500, "stream": True, "fake_token_delay": 0.05}
        self._thread = threading.Thread(target=self._run, args=(lb.url, body), daemon=True)
        self._thread.start()

    def _run(self, url, body):
        with self.client.stream("POST", url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    self.chunks += 1
                if self._stop.is_set():
                    break

    def close(self):
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()


def test_round_robin_alternates(fakes, make_lb):
    a, b = fakes
    lb = make_lb("round_robin", [Upstream("a", a.url), Upstream("b", b.url)])
    order = [served_by(complete(lb)) for _ in range(6)]
    assert order == ["a", "b"] * 3


def test_least_load_sends_new_requests_to_the_idle_replica(fakes, make_lb):
    a, b = fakes
    lb = make_lb("least_load", [Upstream("a", a.url)])
    streams = [LongStream(lb), LongStream(lb)]
    try:
        wait_for(lambda: lb.in_flight("a") == 2, what="two streams on a")
        lb.set_replicas([Upstream("a", a.url), Upstream("b", b.url)])
        assert [served_by(complete(lb)) for _ in range(4)] == ["b"] * 4
        assert lb.in_flight("a") == 2
    finally:
        for stream in streams:
            stream.close()
    wait_for(lambda: lb.in_flight("a") == 0 and lb.in_flight("b") == 0, what="in-flight back to 0")


def test_idle_replicas_share_sequential_requests_under_least_load(fakes, make_lb):
    a, b = fakes
    lb = make_lb("least_load", [Upstream("a", a.url), Upstream("b", b.url)])
    order = [served_by(complete(lb)) for _ in range(6)]
    assert order.count("a") == order.count("b") == 3


def test_in_flight_returns_to_zero_after_errors_and_disconnects(fakes, make_lb):
    a, b = fakes
    lb = make_lb("least_load", [Upstream("a", a.url), Upstream("b", b.url)])
    # The client walks away in the middle of a stream.
    stream = LongStream(lb)
    wait_for(lambda: stream.chunks >= 3, what="stream chunks")
    assert lb.in_flight("a") + lb.in_flight("b") == 1
    stream.close()
    wait_for(lambda: lb.in_flight("a") + lb.in_flight("b") == 0, what="in-flight after a client disconnect")
    # The client gives up on a slow non-streamed request.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(lb.url + "/v1/completions", timeout=0.5,
                   json={"model": "fake", "prompt": "slow", "max_tokens": 100, "fake_token_delay": 0.05})
    wait_for(lambda: lb.in_flight("a") + lb.in_flight("b") == 0, what="in-flight after a client timeout")
    # Every replica answers with an error, streamed or not: passed through, counted (the 500
    # once per replica: each was asked before the client got the last one's answer).
    assert complete(lb, fake_status=500).status_code == 500
    resp = httpx.post(lb.url + "/v1/completions", json={"model": "fake", "prompt": "x", "stream": True,
                                                         "fake_status": 400})
    assert resp.status_code == 400
    assert lb.in_flight("a") == lb.in_flight("b") == 0
    assert metric(lb.url, 'spot_lb_errors_total{kind="http_500"') == 2
    assert metric(lb.url, "spot_lb_accounting_errors_total") == 0


def test_a_replicas_own_5xx_is_retried_on_another_replica(fakes, make_lb):
    # An engine that died under a request answers 500: the client must not see it while
    # another replica can answer (nothing had reached the client).
    a, b = fakes
    lb = make_lb("round_robin", [Upstream("a", a.url), Upstream("b", b.url)])
    for _ in range(4):
        resp = complete(lb, fake_status={"a": 500})
        assert resp.status_code == 200 and served_by(resp) == "b", resp.text
    assert metric(lb.url, 'spot_lb_errors_total{kind="http_500"') >= 2
    assert metric(lb.url, 'spot_lb_retries_total{reason="http_500"}') >= 2
    # A stream the LB cannot continue (echo) whose first replica answers 500 before its first
    # byte: asked again elsewhere too.
    for _ in range(2):
        resp = httpx.post(lb.url + "/v1/completions", timeout=30, json={
            "model": "fake", "prompt": "hello", "max_tokens": 4, "stream": True, "echo": True,
            "fake_status": {"a": 500}})
        assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]"), resp.text


def test_a_replicas_own_5xx_before_a_continuable_streams_first_byte_is_retried_on_another_replica(fakes, make_lb):
    a, b = fakes
    lb = make_lb("round_robin", [Upstream("a", a.url), Upstream("b", b.url)])
    body = {"model": "fake", "prompt": "hello", "max_tokens": 4, "stream": True, "fake_status": {"a": 500}}
    for fake in fakes:
        httpx.delete(fake.url + "/_requests", timeout=5)
    for _ in range(2):  # round robin: one of the two starts on a
        resp = httpx.post(lb.url + "/v1/completions", timeout=30, json=body)
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]"), resp.text
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    asked_a = len(a.received())  # each of a's 500s was asked again on b
    assert asked_a >= 1 and len(b.received()) == 2
    assert metric(lb.url, 'spot_lb_retries_total{reason="http_500"}') == asked_a
    # Every replica answers 503: the client gets the last one's own answer, not a 502 of ours.
    resp = httpx.post(lb.url + "/v1/completions", timeout=30, json={**body, "fake_status": 503})
    assert resp.status_code == 503 and resp.json()["error"]["message"] == "fake failure", resp.text
    assert lb.in_flight("a") == lb.in_flight("b") == 0

def test_connection_refused_is_retried_on_another_replica(fakes, make_lb):
    a, _ = fakes
    lb = make_lb("round_robin", [Upstream("dead", dead_url()), Upstream("a", a.url)])
    for _ in range(4):
        resp = complete(lb)
        assert resp.status_code == 200 and served_by(resp) == "a"
    with httpx.stream("POST", lb.url + "/v1/chat/completions", timeout=30,
                      json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                            "max_tokens": 3}) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert "".join(events).count(" t") == 3
    assert metric(lb.url, 'spot_lb_errors_total{kind="connect",replica="dead"}') >= 2
    assert metric(lb.url, "spot_lb_retries_total") >= 2
    assert lb.in_flight("dead") == lb.in_flight("a") == 0


class ClosesKeptAlive:
    """A replica in front of `fake` that serves the first request of each connection and
    closes the connection when a second one arrives on it, without an answer: what a replica
    does when its keep-alive timer fires just as the LB reuses the connection."""

    def __init__(self, fake: FakeProcess):
        self.fake, self.connections = fake, 0

        class Handler(socketserver.StreamRequestHandler):
            def handle(handler):
                self.connections += 1
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    head += handler.rfile.read(1)
                lines = head.decode("latin-1").split("\r\n")
                length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length"))
                method, target, _ = lines[0].split(" ")
                answer = httpx.request(method, fake.url + target, content=handler.rfile.read(length),
                                       headers={"Content-Type": "application/json"}, timeout=30)
                handler.wfile.write(b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                                    % (answer.status_code, answer.headers["content-type"].encode(),
                                       len(answer.content)) + answer.content)
                handler.wfile.flush()
                handler.rfile.read(1)  # the next request on this connection: close it unanswered

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_kept_alive_connection_closed_under_a_request_is_not_a_failed_replica(fakes, make_lb):
    """Streams go through aiohttp, which resends only idempotent methods on a fresh connection.
    With one replica, a POST whose reused connection is closed under it was a 502."""
    replica = ClosesKeptAlive(fakes[0])
    try:
        lb = make_lb("least_load", [Upstream("a", replica.url)])
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3}
        for body in [chat, chat, {**chat, "n": 2}, {**chat, "n": 2}]:  # continued streams, then passthrough
            with httpx.stream("POST", lb.url + "/v1/chat/completions", json=body, timeout=30) as resp:
                assert resp.status_code == 200, resp.read()
                events = [line for line in resp.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and "error" not in "".join(events)
        assert replica.connections >= 4  # the later requests did meet a closed connection
        assert metric(lb.url, 'spot_lb_errors_total{kind="connect"') == 0
    finally:
        replica.close()


def test_all_tries_failing_gives_502(make_lb):
    lb = make_lb("least_load", [Upstream(f"dead{i}", dead_url()) for i in range(4)])
    resp = complete(lb)
    assert resp.status_code == 502
    assert "3 tries" in resp.json()["error"]["message"]
    assert metric(lb.url, 'spot_lb_errors_total{kind="connect"') == 3


def test_no_ready_replica_gives_503_in_openai_shape(fakes, make_lb):
    a, b = fakes
    lb = make_lb("least_load", [Upstream("a", a.url, ready=False), Upstream("b", b.url, draining=True)])
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [],
                                                                                          "stream": True})]:
        resp = httpx.post(lb.url + path, json={"model": "fake", **body})
        assert resp.status_code == 503
        error = resp.json()["error"]
        assert "no ready replica" in error["message"] and error["code"] == 503 and error["type"]
    assert httpx.get(lb.url + "/health").status_code == 503
    lb.set_replicas([Upstream("a", a.url)])
    assert httpx.get(lb.url + "/health").json()["ready_replicas"] == 1
    assert complete(lb).status_code == 200


def test_models_and_bad_requests(fakes, make_lb):
    a, _ = fakes
    lb = make_lb("least_load", [Upstream("a", a.url)])
    assert httpx.get(lb.url + "/v1/models").json()["data"][0]["id"] == "fake"
    resp = httpx.post(lb.url + "/v1/completions", content=b"{not json")
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    assert httpx.get(lb.url + "/nowhere").status_code == 404


def test_metrics_count_requests_per_replica(fakes, make_lb):
    a, b = fakes
    lb = make_lb("round_robin", [Upstream("a", a.url), Upstream("b", b.url)])
    for _ in range(4):
        complete(lb)
    stream = LongStream(lb)
    try:
        wait_for(lambda: stream.chunks >= 1, what="a streamed chunk")
        text = httpx.get(lb.url + "/metrics").text
        assert 'spot_lb_requests_total{replica="a"} 3.0' in text
        assert 'spot_lb_requests_total{replica="b"} 2.0' in text
        assert 'spot_lb_in_flight{replica="a"} 1.0' in text
        for family in ("spot_lb_errors_total counter", "spot_lb_retries_total counter",
                       "spot_lb_migrations_total counter",
                       "spot_lb_in_flight gauge", "spot_lb_stall_seconds histogram"):
            assert f"# TYPE {family}" in text
    finally:
        stream.close()


def test_openai_client_through_the_lb(fakes, make_lb):
    a, b = fakes
    lb = make_lb("least_load", [Upstream("a", a.url), Upstream("b", b.url)])
    client = openai.OpenAI(base_url=lb.url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="fake", prompt="hello", max_tokens=5, temperature=0)
    assert completion.usage.completion_tokens == 5
    assert completion.choices[0].text.count(" t") == 5
    stream = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.count(" t") == 6
    assert chunks[-1].usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1
    # The LB's own token-id request is invisible to a client that did not ask for ids.
    assert all("token_ids" not in json.dumps(c.model_dump()) for c in chunks)


def test_bad_configuration_is_a_user_error():
    with pytest.raises(UserError, match="load_balancing_policy"):
        LoadBalancer("fastest")
    lb = LoadBalancer()
    with pytest.raises(UserError, match="replica r1: url"):
        lb.set_replicas([Upstream("r1", "localhost:8000")])
