"""The load balancer's request handling under property-based input (hypothesis), over real HTTP
in front of a fake vLLM process: whatever the fields it reads hold, streamed or not, the answer is
a success or an OpenAI-shaped 4xx, never a 5xx the replica did not send; and in-process, the
validated body always plans and starts a stream without an exception."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.fakes.upstream import FakeProcess

from orchestrator.lb.continuation import CHAT, COMPLETIONS, Splice, plan_stream
from orchestrator.lb.limits import Limits
from orchestrator.lb.proxy import LoadBalancer, Upstream
from orchestrator.lb.validate import BadRequest, parse_request

pytestmark = pytest.mark.timeout(300)

odd = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.integers(-2**70, 2**70),
                st.floats(-5, 5, allow_nan=False), st.text(max_size=6), st.lists(st.integers(-2, 5), max_size=3),
                st.lists(st.text(max_size=3), max_size=3), st.dictionaries(st.text(max_size=4), st.booleans(),
                                                                           max_size=2))
FIELDS = ["model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of",
          "temperature", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "return_token_ids",
          "presence_penalty", "response_format", "echo", "logprobs", "prompt", "messages", "top_p", "use_beam_search"]
bodies = st.fixed_dictionaries({}, optional={name: odd for name in FIELDS})
paths = st.sampled_from([COMPLETIONS, CHAT])


@pytest.fixture(scope="module")
def lb():
    fake = FakeProcess("a")
    balancer = LoadBalancer(limits=Limits())
    balancer.start()
    balancer.set_replicas([Upstream("a", fake.url)])
    yield balancer
    balancer.stop()
    fake.stop()


def with_defaults(path: str, body: dict, stream: bool) -> dict:
    base = {"prompt": "hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    out = {**base, **body, "stream": stream if "stream" not in body else body["stream"]}
    if isinstance(out.get("max_tokens"), int) and not isinstance(out.get("max_tokens"), bool):
        out["max_tokens"] = min(out["max_tokens"], 64)  # the fake generates what it is asked
    out.pop("max_completion_tokens", None) if not isinstance(out.get("max_completion_tokens"), int) else None
    return out


@settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(paths, bodies, st.booleans())
def test_no_request_gets_a_5xx_the_replica_did_not_send(lb, path, body, stream):
    sent = with_defaults(path, body, stream)
    resp = httpx.post(lb.url + path, content=json.dumps(sent), timeout=60,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code < 500, (sent, resp.text)
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert error["code"] == resp.status_code and error["message"]
    elif resp.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in resp.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", resp.text[-300:]
        for line in lines[:-1]:
            assert "error" not in json.loads(line[6:]) or json.loads(line[6:])["error"]["code"] < 500


@settings(max_examples=1500, deadline=None, database=None)
@given(paths, bodies)
def test_a_validated_body_always_plans_and_starts(path, body):
    try:
        checked = parse_request(path, json.dumps(body).encode())
    except BadRequest as err:
        assert str(err) and "\n" not in str(err)
        return
    plan = plan_stream(path, checked)
    splice = Splice(plan)
    splice.next_request()
    splice.prompt_ids, splice.generated = [1, 2, 3], [4, 5]
    splice.resume_body()  # what a continuation would send
    json.dumps(splice.first_body())
