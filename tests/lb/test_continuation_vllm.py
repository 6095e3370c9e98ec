"""Stream continuation with two real vLLM CPU replicas of the tiny demo model.

A streamed chat completion through the LB loses its replica mid-stream (the process group is
SIGKILLed, as the local cloud ends a preempted machine; or the LB is told to migrate): the
client's tokens, text and usage must equal those of a run nobody interrupted.
"""

from __future__ import annotations

import threading

import openai
import pytest
from tests.fakes.lb_client import Reader, events, ids_of, metric, text_of

from orchestrator.lb.continuation import Splice
from orchestrator.lb.proxy import LoadBalancer, Upstream
from tests.fakes.vllm_procs import Processes, start_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
MESSAGES = [{"role": "user", "content": "tell me a story about the mountains"}]
CUT_AT = 10  # tokens the LB has streamed when a migration cuts, of MAX_TOKENS
# The tiny model makes a token every 2-3 ms here. Should the LB fall behind it (it shares two
# cores with two vLLM servers; they run niced, as the local cloud runs its machines, because
# at equal priority they starved the LB's loop for a second at a time), the replica may have
# sent everything before a cut: the migration then finds nothing to cut and the test tries
# again. A kill at token 3 lands while the replica still has ~400 tokens to generate.
KILL_AT = 3
MAX_TOKENS = 400
_ON_DATA = Splice.on_data


@pytest.fixture(scope="module")
def replicas(replica_runtime, tiny_model, tmp_path_factory):
    """Two vLLM servers (started together: each takes a minute or more on two cores)."""
    procs = Processes(replica_runtime, tmp_path_factory.mktemp("vllm-logs"))
    urls: dict[str, str] = {}
    errors: list[BaseException] = []

    def start(name: str) -> None:
        try:
            urls[name] = start_vllm(procs, name, tiny_model, max_model_len=512)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=start, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if errors:
            raise errors[0]
        yield procs, urls, str(tiny_model)
    finally:
        procs.kill_all()


@pytest.fixture
def lb():
    balancer = LoadBalancer("least_load")
    balancer.start()
    yield balancer
    balancer.stop()


def chat_body(model: str, **extra) -> dict:
    return {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True}, **extra}


def at_token(monkeypatch, n: int, action) -> threading.Event:
    """Run `action` on the LB's loop once a stream has n tokens (timed from the client side,
    a cut may come after the replica has sent everything)."""
    fired = threading.Event()

    def on_data(self, data):
        result = _ON_DATA(self, data)
        if not fired.is_set() and len(self.generated) >= n:
            fired.set()
            action()
        return result

    monkeypatch.setattr(Splice, "on_data", on_data)
    return fired


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_migrate_continues_a_chat_stream_exactly(replicas, lb, sampling, monkeypatch):
    procs, urls, model = replicas
    body = chat_body(model, **sampling)
    reference = events(urls["b"], "/v1/chat/completions", body)
    assert len(set(ids_of(reference))) > 10  # the demo model does not repeat one token
    assert len(ids_of(reference)) == MAX_TOKENS  # and goes on well past the cut
    for attempt in range(3):
        # A new id for `a` each try: the LB keeps a migrated replica drained for good (ids are
        # never reused), so a second try under the old id would find no routable replica.
        a = f"a{attempt}"
        lb.set_replicas([Upstream(a, urls["a"]), Upstream("b", urls["b"], ready=False)])
        migrations = []

        def cut(migrations=migrations, a=a):
            lb.set_replicas([Upstream(a, urls["a"]), Upstream("b", urls["b"])])
            migrations.append(lb.migrate(a))

        fired = at_token(monkeypatch, CUT_AT, cut)
        reader = Reader(lb.url, "/v1/chat/completions", body)
        reader.join(timeout=600)
        assert fired.is_set(), f"the stream never had {CUT_AT} tokens through the LB: {reader!r}"
        result = migrations[0].result(timeout=120)
        if result.requests:  # else the LB had the whole stream before the cut could run: again
            break
    assert (result.requests, result.resumed) == (1, 1)
    assert reader.error is None and reader.done
    assert ids_of(reader.chunks) == ids_of(reference)
    assert text_of(reader.chunks) == text_of(reference)
    assert reader.chunks[-1]["usage"] == reference[-1]["usage"]
    mode = "resume" if sampling["temperature"] == 0 else "replay"
    assert metric(lb.url, f'spot_lb_migrations_total{{mode="{mode}",reason="cut"}}') == 1


def test_killed_replica_mid_stream_is_invisible_to_the_openai_client(replicas, lb, monkeypatch):
    procs, urls, model = replicas
    body = chat_body(model, temperature=0)
    reference = events(urls["b"], "/v1/chat/completions", body)
    broken = 'spot_lb_migrations_total{mode="resume",reason="broken"}'
    for _attempt in range(3):
        lb.set_replicas([Upstream("a", urls["a"]), Upstream("b", urls["b"], ready=False)])

        def kill():  # from a thread: the LB's loop must go on while the replica dies
            lb.set_replicas([Upstream("a", urls["a"]), Upstream("b", urls["b"])])
            procs.freeze("a")  # now: a fast replica could otherwise finish the stream before it dies
            threading.Thread(target=procs.kill, args=("a",)).start()  # SIGKILL to the process group

        seams_before = metric(lb.url, broken)
        fired = at_token(monkeypatch, KILL_AT, kill)
        client = openai.OpenAI(base_url=lb.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        stream = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True, "ignore_eos": True})
        chunks = list(stream)
        assert fired.is_set()
        ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or ())]
        text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
        assert ids == ids_of(reference)
        if metric(lb.url, broken) > seams_before:
            break
        # A starved LB (a loaded machine) read token 3 only after the replica had sent all of
        # them: the kill came after the stream's end, so nothing was tested. A new `a`, again.
        procs.kill("a")
        urls["a"] = start_vllm(procs, "a", model, max_model_len=512)
    assert text == text_of(reference)
    assert chunks[-1].usage.completion_tokens == reference[-1]["usage"]["completion_tokens"]
    assert chunks[-1].usage.prompt_tokens == reference[-1]["usage"]["prompt_tokens"]
    assert metric(lb.url, broken) == seams_before + 1
    assert metric(lb.url, "spot_lb_continuation_failures_total") == 0
    assert lb.in_flight("a") == lb.in_flight("b") == 0
