"""The load balancer counts the output tokens it serves (what `spotctl cost` divides by), for
unary answers, continuable streams and pass-through streams, over a fake vLLM process."""

from __future__ import annotations

import httpx
import pytest
from tests.fakes.lb_client import events, metric
from tests.fakes.upstream import FakeProcess

from orchestrator.lb.metrics import completion_tokens
from orchestrator.lb.proxy import LoadBalancer, Upstream

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def lb():
    fake = FakeProcess("a")
    balancer = LoadBalancer()
    try:
        balancer.start()
        balancer.set_replicas([Upstream("a", fake.url)])
        yield balancer
    finally:
        balancer.stop()
        fake.stop()


def counted(lb: LoadBalancer, request) -> tuple[int, object]:
    before = lb.metrics.output_tokens_total()
    result = request()
    return lb.metrics.output_tokens_total() - before, result


def test_a_unary_answer_counts_its_usage(lb):
    body = {"model": "fake", "prompt": "hello", "max_tokens": 7}
    delta, resp = counted(lb, lambda: httpx.post(lb.url + "/v1/completions", json=body, timeout=30))
    assert resp.status_code == 200
    assert delta == resp.json()["usage"]["completion_tokens"] > 0
    assert metric(lb.url, "spot_lb_output_tokens_total") == lb.metrics.output_tokens_total()


@pytest.mark.parametrize("extra", [{}, {"logprobs": 1}], ids=["continuable", "pass-through"])
def test_a_stream_counts_the_tokens_the_client_got(lb, extra):
    body = {"model": "fake", "prompt": "hello", "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    delta, chunks = counted(lb, lambda: events(lb.url, "/v1/completions", body))
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and delta == usage[-1]["completion_tokens"] > 0


def test_an_error_answer_counts_nothing(lb):
    body = {"model": "fake", "prompt": "hello", "max_tokens": 7, "fake_status": 400}
    delta, resp = counted(lb, lambda: httpx.post(lb.url + "/v1/completions", json=body, timeout=30))
    assert resp.status_code == 400 and delta == 0


def test_usage_is_read_from_the_raw_bytes_not_from_generated_text():
    assert completion_tokens(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 12}}') == 12
    assert completion_tokens(b'{"text": "say \\"completion_tokens\\": 99", "usage": null}') is None
    assert completion_tokens(b'data: {"choices": []}\n\n') is None
