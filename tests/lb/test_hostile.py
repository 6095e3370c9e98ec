"""The load balancer under hostile input, over real HTTP in front of fake vLLM processes: bad
parameters get OpenAI-shaped 400s streamed or not, a replica's error inside a stream keeps its
status, bodies, headers, connections and streams per client are bounded, and nothing is a
plain-text 500."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from tests.fakes.lb_client import events, wait_for
from tests.fakes.upstream import FakeProcess

from orchestrator.lb.limits import Limits
from orchestrator.lb.proxy import LoadBalancer, Upstream

pytestmark = pytest.mark.timeout(120)

BAD = [
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"max_tokens": "x"}, "max_tokens"),
    ("/v1/completions", {"stop": 5}, "stop"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"stream_options": "x"}, "stream_options"),
    ("/v1/completions", {"min_tokens": "x"}, "min_tokens"),
    ("/v1/completions", {"seed": "x"}, "seed"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"min_tokens": 9, "max_tokens": 3}, None),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": 7}, "model"),
]


@pytest.fixture(scope="module")
def fake():
    process = FakeProcess("a")
    yield process
    process.stop()


@pytest.fixture
def make_lb(fake):
    started = []

    def make(**limits) -> LoadBalancer:
        lb = LoadBalancer(limits=Limits(**limits))
        lb.start()
        lb.set_replicas([Upstream("a", fake.url)])
        started.append(lb)
        return lb

    yield make
    for lb in started:
        lb.stop()


def request_body(path: str, extra: dict) -> dict:
    base = {"prompt": "hello"} if path.endswith("/completions") and "chat" not in path else \
        {"messages": [{"role": "user", "content": "hi"}]}
    return {"model": "fake", "max_tokens": 4, **base, **extra}


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["code"] == status and error["message"] and "\n" not in error["message"]
    return error


@pytest.mark.parametrize("path, extra, param", BAD)
def test_bad_parameters_get_the_same_openai_400_streamed_or_not(make_lb, path, extra, param):
    lb = make_lb()
    errors = []
    for stream in (True, False):
        resp = httpx.post(lb.url + path, json={**request_body(path, extra), "stream": stream}, timeout=30)
        error = assert_openai_error(resp, 400)
        assert error["type"] == "invalid_request_error" and error["param"] == param
        errors.append(error)
    assert errors[0] == errors[1]


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"prompt": NaN}', b"[" * 100_000, b"\xff\xfe"])
def test_bodies_that_are_not_json_objects_get_400(make_lb, raw):
    lb = make_lb()
    assert_openai_error(httpx.post(lb.url + "/v1/completions", content=raw), 400)


def test_a_request_without_model_is_served_by_the_replicas_default_streamed_or_not(make_lb):
    lb = make_lb()
    body = {"prompt": "hello", "max_tokens": 3}
    unary = httpx.post(lb.url + "/v1/completions", json=body, timeout=30)
    assert unary.status_code == 200 and unary.json()["model"] == "fake"
    chunks = events(lb.url, "/v1/completions", {**body, "stream": True})
    assert {c["model"] for c in chunks} == {"fake"}


def test_an_error_inside_a_stream_reaches_the_client_with_the_replicas_status(make_lb, fake):
    lb = make_lb()
    httpx.delete(fake.url + "/_requests")
    body = request_body("/v1/completions", {"stream": True, "max_tokens": 10,
                                            "fake_stream_error": {"after": 2, "status": 400}})
    with httpx.stream("POST", lb.url + "/v1/completions", json=body, timeout=30) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == 400 and "fake error" in error["message"]
    assert len([json.loads(x) for x in lines[:-2]]) == 2  # the two tokens before it
    assert len(fake.received()) == 1  # a 4xx is the client's answer, not a reason to retry


def test_bodies_beyond_the_limit_get_413_declared_or_chunked(make_lb):
    lb = make_lb(max_body_bytes=1000)
    assert_openai_error(httpx.post(lb.url + "/v1/completions", content=b"x" * 2000), 413)

    def chunks():
        for _ in range(10):
            yield b"x" * 500

    assert_openai_error(httpx.post(lb.url + "/v1/completions", content=chunks()), 413)
    assert httpx.post(lb.url + "/v1/completions", json=request_body("/v1/completions", {})).status_code == 200


def connect(lb: LoadBalancer) -> socket.socket:
    host, port = lb.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed(sock: socket.socket, wait: float = 5.0) -> bytes | None:
    """What the server sent before closing `sock`, or None while it stays open."""
    sock.settimeout(wait)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return None
    return data


def test_slow_or_huge_headers_and_bad_http_get_json_errors(make_lb):
    lb = make_lb(header_timeout_s=0.5, max_header_bytes=4096)
    silent = connect(lb)  # connects and says nothing: closed after the header timeout
    assert closed(silent) == b""
    slow = connect(lb)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    answer = closed(slow)
    assert answer.startswith(b"HTTP/1.1 408") and b'"code": 408' in answer
    huge = connect(lb)
    huge.sendall(b"GET /health HTTP/1.1\r\nX-Big: " + b"y" * 8000 + b"\r\n")
    assert closed(huge).startswith(b"HTTP/1.1 431")
    garbage = connect(lb)
    garbage.sendall(b"\x16\x03\x01 this is no HTTP\r\n\r\n")
    answer = closed(garbage)
    assert answer.startswith(b"HTTP/1.1 400") and b'"error"' in answer
    assert httpx.get(lb.url + "/health").status_code == 200


def test_past_the_connection_cap_idle_connections_make_room_and_busy_ones_refuse(make_lb):
    lb = make_lb(max_connections=4)
    idle = [connect(lb) for _ in range(4)]
    wait_for(lambda: len(lb.guard) == 4, what="four idle connections")
    assert httpx.get(lb.url + "/health").status_code == 200  # took the place of the longest idle
    assert closed(idle[0], 2) == b"" and lb.guard.evicted >= 1
    for sock in idle:
        sock.close()
    wait_for(lambda: len(lb.guard) == 0, what="the connections to go")
    # Four long streams hold every connection: a fifth is refused in OpenAI's shape.
    stop = threading.Event()

    def stream():
        body = request_body("/v1/completions", {"stream": True, "max_tokens": 200, "fake_token_delay": 0.02})
        with httpx.stream("POST", lb.url + "/v1/completions", json=body, timeout=30) as resp:
            for _ in resp.iter_lines():
                if stop.is_set():
                    break

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: lb.in_flight("a") == 4, what="four streams")
        refused = httpx.get(lb.url + "/health")
        assert_openai_error(refused, 503)
        assert refused.headers["retry-after"] == "2"  # every 503 says when to come back
        assert lb.guard.refused >= 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)


def test_streams_per_client_are_limited_when_asked(make_lb):
    lb = make_lb(max_streams_per_client=1)
    body = request_body("/v1/completions", {"stream": True, "max_tokens": 400, "fake_token_delay": 0.05})
    with httpx.stream("POST", lb.url + "/v1/completions", json=body, timeout=30) as first:
        lines = first.iter_lines()
        next(lines)
        error = assert_openai_error(httpx.post(lb.url + "/v1/completions", json=body), 429)
        assert error["type"] == "rate_limit_error"
    wait_for(lambda: lb.in_flight("a") == 0, what="the first stream to end")
    assert httpx.post(lb.url + "/v1/completions", json={**body, "max_tokens": 2}).status_code == 200


def test_a_bug_in_the_load_balancer_is_a_json_500_not_plain_text(make_lb, monkeypatch):
    lb = make_lb()

    async def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(lb, "_unary", broken)
    assert_openai_error(httpx.post(lb.url + "/v1/completions", json=request_body("/v1/completions", {})), 500)
    assert httpx.get(lb.url + "/health").status_code == 200


def test_limits_from_the_environment_and_their_errors():
    limits = Limits.from_env({"SPOT_ORCHESTRATOR_LB_MAX_CONNECTIONS": "8192",
                              "SPOT_ORCHESTRATOR_LB_HEADER_TIMEOUT_S": "2.5"})
    assert limits.max_connections == 8192 and limits.header_timeout_s == 2.5
    from orchestrator.common.errors import UserError
    for bad in ("0", "-1", "x", "inf"):
        with pytest.raises(UserError, match="SPOT_ORCHESTRATOR_LB_MAX_BODY_BYTES"):
            Limits.from_env({"SPOT_ORCHESTRATOR_LB_MAX_BODY_BYTES": bad})
