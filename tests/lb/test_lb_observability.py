"""The load balancer's observability over real HTTP in front of fake vLLM processes: latency by
status and time to first token in /metrics, a departed replica's series gone, X-Request-Id
passed to the replica and back, Retry-After on its 503s."""

from __future__ import annotations

import httpx
import pytest
from tests.fakes.lb_client import events

from orchestrator.lb.proxy import LoadBalancer, Upstream

pytestmark = pytest.mark.timeout(120)

BODY = {"model": "fake", "prompt": "hello", "max_tokens": 4}


@pytest.fixture
def lb(fakes):
    balancer = LoadBalancer("round_robin")
    balancer.start()
    balancer.set_replicas([Upstream(f.name, f.url) for f in fakes])
    yield balancer
    balancer.stop()


def scrape(lb: LoadBalancer) -> str:
    return httpx.get(lb.url + "/metrics", timeout=10).text


def test_latency_by_status_and_time_to_first_token_are_histograms(lb):
    assert httpx.post(lb.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
    assert httpx.post(lb.url + "/v1/completions", json={**BODY, "max_tokens": 0}, timeout=30).status_code == 400
    events(lb.url, "/v1/completions", {**BODY, "stream": True})
    text = scrape(lb)
    assert 'spot_lb_request_seconds_count{status="200"} 2.0' in text  # the unary and the stream
    assert 'spot_lb_request_seconds_count{status="400"} 1.0' in text
    assert 'spot_lb_request_seconds_bucket{le="+Inf",status="200"} 2.0' in text
    assert "spot_lb_time_to_first_token_seconds_count 1.0" in text  # streams only
    assert 'spot_lb_request_seconds_count{status="200"} 2.0' in scrape(lb)  # scrapes are not client traffic


def test_a_replica_that_leaves_takes_its_series_with_it(lb, fakes):
    for _ in range(4):  # round robin: both replicas served
        httpx.post(lb.url + "/v1/completions", json=BODY, timeout=30)
    lb.metrics.errors.labels("b", "connect").inc()
    text = scrape(lb)
    assert 'spot_lb_requests_total{replica="b"}' in text and 'spot_lb_errors_total{kind="connect",replica="b"}' in text
    lb.set_replicas([Upstream("a", fakes[0].url)])
    text = scrape(lb)
    assert 'replica="b"' not in text
    assert 'spot_lb_requests_total{replica="a"}' in text


def test_x_request_id_goes_to_the_replica_and_back(lb, fakes):
    for fake in fakes:
        httpx.delete(fake.url + "/_requests", timeout=5)
    sent = httpx.post(lb.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "client-42"}, timeout=30)
    assert sent.headers["x-request-id"] == "client-42"
    made = httpx.post(lb.url + "/v1/completions", json=BODY, timeout=30)
    generated = made.headers["x-request-id"]
    assert len(generated) == 32
    posing = httpx.post(lb.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "seam-" + "0" * 32},
                        timeout=30)
    assert not posing.headers["x-request-id"].startswith("seam-")  # continuations' ids are the LB's own
    with httpx.stream("POST", lb.url + "/v1/completions", json={**BODY, "stream": True},
                      headers={"X-Request-Id": "stream-7"}, timeout=30) as streamed:
        streamed.read()
        assert streamed.headers["x-request-id"] == "stream-7"
    seen = {r["request_id"] for fake in fakes for r in fake.received()}
    assert {"client-42", generated, "stream-7"} <= seen


def test_every_503_carries_retry_after(lb):
    lb.set_replicas([])
    refused = httpx.post(lb.url + "/v1/completions", json=BODY, timeout=30)
    assert refused.status_code == 503 and "no ready replica" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "2"
    assert refused.headers["x-request-id"]
    health = httpx.get(lb.url + "/health", timeout=10)
    assert health.status_code == 503 and health.headers["retry-after"] == "2"


def test_a_replicas_own_503_gets_retry_after_too(lb):
    answer = httpx.post(lb.url + "/v1/completions", json={**BODY, "fake_status": 503}, timeout=30)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "2"
