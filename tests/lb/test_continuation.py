"""Stream continuation across replicas against fake vLLM upstreams run as processes.

The fake generates each token as a function of the sequence so far (and, when seeded, of a
per-request generator, as vLLM does), so a continuation is correct exactly when the client's
tokens equal an uninterrupted run's. `fake_die_after` makes a replica process exit mid-stream.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from tests.fakes.lb_client import Reader, events, ids_of, metric, text_of
from tests.fakes.upstream import GLITCH, FakeProcess, chat_prompt, is_partial, tokenize

from orchestrator.lb.continuation import COMPLETIONS, Mode, Splice, StopMatcher, plan_stream
from orchestrator.lb.proxy import LoadBalancer, Upstream

pytestmark = pytest.mark.timeout(120)
MESSAGES = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture
def pair():
    """Replicas a and b behind a round-robin LB: the first request goes to a."""
    fakes = []
    lb = LoadBalancer("round_robin")
    try:
        fakes += [FakeProcess("a"), FakeProcess("b")]
        a, b = fakes
        lb.start()
        lb.set_replicas([Upstream("a", a.url), Upstream("b", b.url)])
        yield lb, a, b
    finally:
        lb.stop()
        for fake in fakes:
            fake.stop()


def test_greedy_chat_stream_continues_token_exact_after_a_kill(pair):
    lb, a, b = pair
    body = {"model": "fake", "messages": MESSAGES, "max_tokens": 20, "temperature": 0}
    reference = events(b.url, "/v1/chat/completions", dict(body, stream=True))
    client = openai.OpenAI(base_url=lb.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True},
        extra_body={"fake_die_after": {"a": 7}, "fake_token_delay": 0.01}))
    assert a.proc.wait(timeout=10) == 1  # replica a really died mid-stream
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == text_of(reference) and text.count(" t") == 20
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-a-")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    prompt_ids = tokenize(chat_prompt(MESSAGES))
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert chunks[-1].usage.completion_tokens == 20
    # b continued from token ids: the templated prompt + the 7 tokens a had streamed.
    (resume,) = [r for r in b.received() if r["path"] == COMPLETIONS]
    assert resume["body"]["prompt"][: len(prompt_ids)] == prompt_ids
    assert len(resume["body"]["prompt"]) == len(prompt_ids) + 7 and resume["body"]["max_tokens"] == 13
    assert metric(lb.url, 'spot_lb_migrations_total{mode="resume",reason="broken"}') == 1
    assert metric(lb.url, "spot_lb_migrated_tokens_total") == 7
    assert metric(lb.url, "spot_lb_stall_seconds_count") == 1
    assert metric(lb.url, "spot_lb_continuation_failures_total") == 0
    assert lb.in_flight("a") == lb.in_flight("b") == 0


def test_completion_stream_token_ids_and_budget(pair):
    lb, a, b = pair
    body = {"model": "fake", "prompt": "once upon a time", "max_tokens": 12, "temperature": 0, "stream": True,
            "return_token_ids": True}
    reference = events(b.url, COMPLETIONS, body)
    chunks = events(lb.url, COMPLETIONS, dict(body, fake_die_after={"a": 11}))
    assert ids_of(chunks) == ids_of(reference) and len(ids_of(chunks)) == 12
    assert text_of(chunks) == text_of(reference)
    # prompt ids once, on the first chunk, as vLLM does; they were asked for here
    with_prompt = [c for c in chunks if "prompt_token_ids" in c["choices"][0]]
    assert with_prompt == chunks[:1] and with_prompt[0]["choices"][0]["prompt_token_ids"] == tokenize(body["prompt"])
    resume = [r["body"] for r in b.received() if r["body"].get("prompt") != body["prompt"]]
    assert resume[-1]["max_tokens"] == 1  # the remaining budget


@pytest.mark.parametrize("want_ids", [True, False])
def test_seam_right_after_a_held_back_token(pair, want_ids):
    lb, a, b = pair
    body = {"model": "fake", "prompt": "once upon a time", "max_tokens": 30, "temperature": 0, "stream": True,
            "return_token_ids": True}
    reference = events(b.url, COMPLETIONS, body)
    ids = ids_of(reference)
    die = next(i + 1 for i, t in enumerate(ids[:-1]) if is_partial(t))  # a's last token holds its text
    clean = die
    while clean and is_partial(ids[clean - 1]):
        clean -= 1
    chunks = events(lb.url, COMPLETIONS, dict(body, return_token_ids=want_ids, fake_die_after={"a": die},
                                              stream_options={"include_usage": True}))
    assert text_of(chunks) == text_of(reference) and GLITCH not in text_of(chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 30
    if want_ids:
        assert ids_of(chunks) == ids
    # b resumed at the last token that released text and regenerated the held-back ones.
    (resume,) = [r["body"] for r in b.received() if r["body"]["prompt"] != body["prompt"]]
    assert resume["prompt"] == tokenize(body["prompt"]) + ids[:clean]


def test_seeded_sampling_is_continued_by_replay(pair):
    lb, a, b = pair
    body = {"model": "fake", "messages": MESSAGES, "max_tokens": 16, "temperature": 0.8, "seed": 42,
            "stream": True, "return_token_ids": True}
    reference = ids_of(events(b.url, "/v1/chat/completions", body))
    chunks = events(lb.url, "/v1/chat/completions", dict(body, fake_die_after={"a": 6}))
    assert ids_of(chunks) == reference
    # b got the original request again (a replay), not a token-id continuation ...
    assert [r["path"] for r in b.received()] == ["/v1/chat/completions"] * 2
    assert metric(lb.url, 'spot_lb_migrations_total{mode="replay",reason="broken"}') == 1
    assert metric(lb.url, "spot_lb_replayed_tokens_total") == 6
    # ... because resuming from ids restarts the seeded generator and gives other tokens.
    prompt_ids = tokenize(chat_prompt(MESSAGES))
    resumed = ids_of(events(b.url, COMPLETIONS, {"prompt": prompt_ids + reference[:6], "max_tokens": 10,
                                                 "temperature": 0.8, "seed": 42, "stream": True,
                                                 "return_token_ids": True}))
    assert resumed != reference[6:]


def test_unseeded_sampling_continues_with_the_right_count(pair):
    lb, a, b = pair
    body = {"model": "fake", "prompt": "random", "max_tokens": 15, "temperature": 1.0, "stream": True,
            "stream_options": {"include_usage": True}, "fake_die_after": {"a": 5}}
    chunks = events(lb.url, COMPLETIONS, body)
    assert text_of(chunks).count(" t") == 15
    assert chunks[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 15, "total_tokens": 21}
    assert all("token_ids" not in c["choices"][0] for c in chunks if c["choices"])
    assert metric(lb.url, 'spot_lb_migrations_total{mode="resume"') == 1


def test_stop_string_straddling_the_seam_is_honoured(pair):
    lb, a, b = pair
    body = {"model": "fake", "prompt": "stops", "max_tokens": 20, "temperature": 0, "stream": True}
    pieces = [text_of([c]) for c in events(b.url, COMPLETIONS, body)]
    full = "".join(pieces)
    stop = pieces[4][-2:] + pieces[5][:3]  # ends of tokens 5 and 6: a die after 5 splits it
    cut_at = full.find(stop)
    assert cut_at == len("".join(pieces[:5])) - 2  # first occurrence is the straddling one
    chunks = events(lb.url, COMPLETIONS, dict(body, stop=[stop, "never"], fake_die_after={"a": 5},
                                              stream_options={"include_usage": True}))
    assert text_of(chunks) == full[:cut_at]
    final = [c["choices"][0] for c in chunks if c["choices"]][-1]
    assert final["finish_reason"] == "stop" and final["stop_reason"] == stop
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert all("stop" not in r["body"] for r in b.received())  # matched by the LB, across the seam


def test_stop_string_with_include_stop_str_in_output(pair):
    lb, a, b = pair
    body = {"model": "fake", "prompt": "stops", "max_tokens": 20, "temperature": 0, "stream": True}
    pieces = [text_of([c]) for c in events(b.url, COMPLETIONS, body)]
    stop = pieces[2][-2:] + pieces[3][:2]
    chunks = events(lb.url, COMPLETIONS, dict(body, stop=stop, include_stop_str_in_output=True))
    full = "".join(pieces)
    assert text_of(chunks) == full[: full.find(stop) + len(stop)]


def test_migrate_flushes_then_cuts_and_continues(pair):
    lb, a, b = pair
    stream_body = {"model": "fake", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "stream": True,
                   "return_token_ids": True, "fake_token_delay": 0.03}
    unary_body = {"model": "fake", "prompt": "unary", "max_tokens": 30, "temperature": 0, "fake_token_delay": 0.05}
    reference = ids_of(events(b.url, "/v1/chat/completions", stream_body))
    unary_reference = httpx.post(b.url + COMPLETIONS, json=unary_body, timeout=30).json()["choices"][0]["text"]
    lb.set_replicas([Upstream("a", a.url)])  # both requests start on a
    reader = Reader(lb.url, "/v1/chat/completions", stream_body)
    unary: dict = {}
    unary_thread = threading.Thread(target=lambda: unary.update(
        httpx.post(lb.url + COMPLETIONS, json=unary_body, timeout=60).json()), daemon=True)
    unary_thread.start()
    deadline = time.monotonic() + 20
    while (len(reader.chunks) < 6 or lb.in_flight("a") < 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    lb.set_replicas([Upstream("a", a.url), Upstream("b", b.url)])
    seen_at_flush = []

    def flush():  # the lead's KV flush: runs before the cut, while a still serves
        seen_at_flush.append((lb.in_flight("a"), len(reader.chunks)))
        time.sleep(0.1)

    result = lb.migrate("a", before_cut=flush).result(timeout=30)
    assert (result.requests, result.resumed, result.failed) == (2, 2, 0)
    assert seen_at_flush[0][0] == 2
    assert [u.draining for u in lb.replicas() if u.replica_id == "a"] == [True]
    reader.join(timeout=30)
    unary_thread.join(timeout=30)
    assert reader.error is None
    assert ids_of(reader.chunks) == reference
    assert unary["choices"][0]["text"] == unary_reference
    assert metric(lb.url, 'spot_lb_migrations_total{mode="resume",reason="cut"}') == 1
    assert metric(lb.url, 'spot_lb_migrations_total{mode="restart",reason="cut"}') == 1
    assert lb.in_flight("a") == lb.in_flight("b") == 0
    assert a.proc.poll() is None  # nothing died: the cut alone moved the requests


def test_no_replica_left_ends_the_stream_with_an_error(pair):
    lb, a, b = pair
    lb.set_replicas([Upstream("a", a.url)])
    client = openai.OpenAI(base_url=lb.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"fake_die_after": {"a": 3}})
    with pytest.raises(openai.APIError, match="could not be continued"):
        list(stream)
    assert metric(lb.url, 'spot_lb_continuation_failures_total{reason="no_replica"}') == 1
    assert lb.in_flight("a") == 0


def test_a_stream_that_cannot_be_continued_says_so(pair):
    lb, a, b = pair
    body = {"model": "fake", "prompt": "x", "max_tokens": 10, "stream": True, "logprobs": 1,
            "fake_die_after": {"a": 3}}
    with httpx.stream("POST", lb.url + COMPLETIONS, json=body, timeout=30) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
    assert metric(lb.url, 'spot_lb_continuation_failures_total{reason="not_continuable"}') == 1


# -- the pieces, without processes ---------------------------------------------------------------

def test_plan_modes():
    assert plan_stream(COMPLETIONS, {"prompt": "x", "temperature": 0}).mode is Mode.RESUME
    assert plan_stream(COMPLETIONS, {"prompt": "x"}).mode is Mode.RESUME
    assert plan_stream(COMPLETIONS, {"prompt": "x", "seed": 1}).mode is Mode.REPLAY
    assert plan_stream(COMPLETIONS, {"prompt": "x", "seed": 1, "temperature": 0}).mode is Mode.RESUME
    assert plan_stream(COMPLETIONS, {"prompt": "x", "presence_penalty": 0.5}).mode is Mode.REPLAY
    assert plan_stream("/v1/chat/completions", {"messages": [], "response_format": {"type": "json_object"}}
                       ).mode is Mode.REPLAY
    assert plan_stream(COMPLETIONS, {"prompt": ["a", "b"]}).mode is Mode.NONE
    assert plan_stream(COMPLETIONS, {"prompt": [1, 2, 3]}).mode is Mode.RESUME
    assert plan_stream(COMPLETIONS, {"prompt": "x", "n": 2}).mode is Mode.NONE
    assert plan_stream("/v1/chat/completions", {"messages": [], "tools": [{}]}).mode is Mode.NONE


def test_stop_matcher_holds_back_and_matches_earliest():
    m = StopMatcher(("abc", "cd"), include=False)
    assert m.feed("xxa", True) == ("x", None)  # "xa" could still start "abc": held back
    assert m.feed("b", True) == ("x", None)
    assert m.feed("cd", True) == ("", "abc")  # "abc" ends before "cd" does; nothing of it is sent
    m = StopMatcher(("zz",), include=True)
    assert m.feed("a", True) == ("a", None) and m.feed("zzq", True) == ("zz", "zz")


def _chunk(ids, text, finish=None, prompt=None):
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return json.dumps({"id": "cmpl-1", "created": 1, "model": "m", "choices": [choice]}).encode()


def test_replay_divergence_falls_back_to_resume():
    splice = Splice(plan_stream(COMPLETIONS, {"prompt": "x", "seed": 7, "max_tokens": 5}))
    assert splice.next_request()[2] is None
    splice.on_data(_chunk([5], " a", prompt=[1, 2]))
    splice.on_data(_chunk([6], " b"))
    splice.begin_seam()
    path, body, mode = splice.next_request()
    assert mode is Mode.REPLAY and path == COMPLETIONS and body["prompt"] == "x"
    splice.on_data(_chunk([5], " a", prompt=[1, 2]))
    with pytest.raises(Exception, match="replay gave token 9"):
        splice.on_data(_chunk([9], " z"))
    splice.replay_diverged()
    path, body, mode = splice.next_request()
    assert mode is Mode.RESUME and body["prompt"] == [1, 2, 5, 6] and body["max_tokens"] == 3
    assert body["seed"] == 9  # reproducible, but not the original generator's draws
    out, new = splice.on_data(_chunk([8], " c"))
    assert new == 1 and b'" c"' in out[0] and splice.generated == [5, 6, 8]


def test_unseeded_seam_drops_held_back_tokens_the_client_never_saw():
    for want_ids, expected_prompt in [(False, [1, 2, 5]), (True, [1, 2, 5, 7])]:
        splice = Splice(plan_stream(COMPLETIONS, {"prompt": "x", "max_tokens": 5, "return_token_ids": want_ids}))
        splice.next_request()
        splice.on_data(_chunk([5], " a", prompt=[1, 2]))
        splice.on_data(_chunk([7], ""))  # bytes held back by the replica
        splice.begin_seam()
        path, body, mode = splice.next_request()
        assert mode is Mode.RESUME and body["prompt"] == expected_prompt
        assert body["max_tokens"] == 5 - (len(expected_prompt) - 2)


def test_a_replica_without_token_ids_cannot_be_resumed():
    splice = Splice(plan_stream(COMPLETIONS, {"prompt": "x", "max_tokens": 5}))
    splice.next_request()
    assert splice.continuable()  # nothing sent yet: starting over is invisible
    chunk = json.dumps({"id": "c", "created": 1, "model": "m",
                        "choices": [{"index": 0, "text": " a", "finish_reason": None}]}).encode()
    splice.on_data(chunk)
    assert not splice.continuable()


def test_before_resume_runs_between_the_cut_and_the_continuation(pair):
    lb, a, b = pair
    body = {"model": "fake", "prompt": "gate", "max_tokens": 40, "temperature": 0, "stream": True,
            "return_token_ids": True, "fake_token_delay": 0.03}
    reference = ids_of(events(b.url, COMPLETIONS, body))
    lb.set_replicas([Upstream("a", a.url)])
    reader = Reader(lb.url, COMPLETIONS, body)
    deadline = time.monotonic() + 20
    while len(reader.chunks) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    lb.set_replicas([Upstream("a", a.url), Upstream("b", b.url)])
    seen = []

    def flush():  # after the cut: nothing resumed on b yet, and the client gets nothing meanwhile
        time.sleep(0.05)  # lets the bytes sent before the cut reach the reader
        seen.append((lb.in_flight("b"), len(reader.chunks)))
        time.sleep(0.3)
        seen.append(len(reader.chunks))

    result = lb.migrate("a", before_resume=flush).result(timeout=30)
    reader.join(timeout=30)
    assert (result.requests, result.resumed) == (1, 1)
    (on_b, chunks_then), chunks_after = seen
    assert on_b == 0 and chunks_after == chunks_then  # the stream waited for the flush
    assert ids_of(reader.chunks) == reference
