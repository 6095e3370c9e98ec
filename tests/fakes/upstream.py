"""A fake vLLM OpenAI server for load-balancer tests and the LB benchmark (run as a process).

    python tests/fakes/upstream.py --port 8101 --name a [--token-delay 0.01]

It answers /v1/completions and /v1/chat/completions (streamed or not) in vLLM's shapes,
including `return_token_ids` (token_ids per choice, prompt_token_ids on the first chunk),
`stream_options.include_usage`, `stop_token_ids`, stop strings and `max_tokens`/`min_tokens`.
Generation is a deterministic function of the token sequence, so a continuation from
prompt + generated ids must reproduce an uninterrupted run exactly:

- greedy (temperature 0 or unset without a seed): next = f(all tokens so far);
- seeded (temperature > 0, seed): like vLLM, a generator seeded once per request and advanced
  per token, so a request that starts over from a longer prompt restarts the generator;
- unseeded sampling: fresh randomness.

Test knobs in the request body: `fake_token_delay` (s/token), `fake_status` (answer that
HTTP status; {replica name: status}: only those do), `fake_die_after` ({replica name: n}: the
process exits after streaming n tokens, as a killed replica would), `fake_stream_error`
({"after": n, "status": s}: an error event in vLLM's shape after n tokens). Like vLLM, a
request it cannot read gets a 400 (and a budget past its context of MAX_MODEL_LEN tokens too),
never a 500. GET /_requests lists the bodies received
and their X-Request-Id (DELETE clears them).
The replica's name is returned as `system_fingerprint`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

VOCAB = 1000
MAX_MODEL_LEN = 4096


def tokenize(text: str) -> list[int]:
    return [b % 200 + 1 for b in text.encode()]


def detokenize(token: int) -> str:
    return f" t{token}"


def is_partial(token: int) -> bool:
    """Tokens that, like a byte inside a UTF-8 character, release their text only with the next."""
    return token % 7 == 0


GLITCH = "<prompt text>"  # what vLLM's detokenizer emits first when a prompt ends in a partial token


def chat_prompt(messages: list[dict]) -> str:
    return "".join(f"<{m.get('role')}>{m.get('content')}" for m in messages) + "<assistant>"


def greedy_next(seq: list[int]) -> int:
    a = seq[-1] if seq else 0
    b = seq[-2] if len(seq) > 1 else 0
    return (a * 7 + b * 13 + len(seq) * 3) % (VOCAB - 1) + 1


class Sampler:
    """One request's sampler: greedy, seeded (generator restarts per request) or random."""

    def __init__(self, body: dict):
        temperature = body.get("temperature")
        seed = body.get("seed")
        self.greedy = temperature == 0 or (temperature is None and seed is None)
        self.rng = random.Random(seed) if seed is not None else random.Random()

    def next(self, seq: list[int]) -> int:
        base = greedy_next(seq)
        if self.greedy:
            return base
        return (base + self.rng.randrange(VOCAB)) % (VOCAB - 1) + 1


class Fake:
    def __init__(self, name: str, token_delay: float):
        self.name = name
        self.token_delay = token_delay
        self.requests: list[dict] = []
        self.tokens_streamed = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        raw = b""
        more = True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        if path == "/_requests":
            if method == "DELETE":
                self.requests.clear()
            return await self.json(send, 200, self.requests)
        if path == "/health":
            return await self.json(send, 200, {})
        if path == "/v1/models":
            return await self.json(send, 200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await self.json(send, 404, {"error": {"message": "no route", "code": 404}})
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return await self.bad_request(send, "request body is not a JSON object")
        request_id = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        self.requests.append({"path": path, "body": body, "request_id": request_id})
        status = body.get("fake_status")
        if isinstance(status, dict):  # {replica name: status}: only those replicas fail
            status = status.get(self.name)
        if status:
            status = int(status)
            return await self.json(send, status, {"error": {"message": "fake failure", "type": "server_error",
                                                            "code": status}})
        chat = path == "/v1/chat/completions"
        try:
            prompt_ids = self.prompt_ids(body, chat)
            budget = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            int(body.get("min_tokens") or 0), float(body.get("fake_token_delay") or 0)
            set(body.get("stop_token_ids") or ())
        except (TypeError, ValueError, AttributeError) as err:
            return await self.bad_request(send, f"invalid request: {err}")
        if len(prompt_ids) + budget > MAX_MODEL_LEN:
            return await self.bad_request(send, f"this model's maximum context length is {MAX_MODEL_LEN} tokens")
        gen = self.generate(body, prompt_ids)
        ident = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{len(self.requests)}",
                 "created": int(time.time()), "model": body.get("model") or "fake",
                 "system_fingerprint": self.name}
        if body.get("stream"):
            return await self.stream(send, body, chat, ident, prompt_ids, gen)
        tokens, text, finish, stop_reason = [], "", None, None
        async for token, piece, last_finish, last_stop_reason in gen:
            tokens.append(token)
            text += piece
            finish, stop_reason = last_finish, last_stop_reason
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(tokens),
                 "total_tokens": len(prompt_ids) + len(tokens)}
        want_ids = body.get("return_token_ids")
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish, "stop_reason": stop_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": stop_reason}
            if want_ids:
                choice["prompt_token_ids"] = prompt_ids
        if want_ids:
            choice["token_ids"] = tokens
        result = dict(ident, object="chat.completion" if chat else "text_completion", choices=[choice],
                      usage=usage)
        if chat and want_ids:
            result["prompt_token_ids"] = prompt_ids
        return await self.json(send, 200, result)

    @staticmethod
    def prompt_ids(body: dict, chat: bool) -> list[int]:
        prompt = body.get("prompt")
        if chat:
            return tokenize(chat_prompt(list(body.get("messages") or [])))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return [int(t) for t in prompt]
        ids = tokenize(str(prompt[0]) if isinstance(prompt, list) and prompt else str(prompt))
        return ids or [1]

    async def bad_request(self, send, message: str) -> None:
        await self.json(send, 400, {"error": {"message": message, "type": "BadRequestError", "param": None,
                                              "code": 400}})

    async def generate(self, body: dict, prompt_ids: list[int]):
        """Yields (token, text, finish_reason, stop_reason); the last one has a finish_reason."""
        sampler = Sampler(body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        min_tokens = body.get("min_tokens") or 0
        stop_ids = set(body.get("stop_token_ids") or ())
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        delay = body.get("fake_token_delay", self.token_delay)
        seq = list(prompt_ids)
        text = ""
        pending = GLITCH if body.get("prompt") == prompt_ids and is_partial(prompt_ids[-1]) else ""
        for n in range(1, max_tokens + 1):
            if delay:
                await asyncio.sleep(delay)
            token = sampler.next(seq)
            seq.append(token)
            piece = detokenize(token)
            text += piece
            last = n == max_tokens or (token in stop_ids and n > min_tokens)
            if is_partial(token) and not last:  # held back, as vLLM holds incomplete characters
                pending += piece
                yield token, "", None, None
                continue
            piece, pending = pending + piece, ""
            if token in stop_ids and n > min_tokens:
                yield token, piece, "stop", token
                return
            if stops and n > min_tokens:  # no hold-back: the fake sends what it generated
                start = len(text) - len(piece)
                found = [(text.find(s, max(0, start - len(s) + 1)), s) for s in stops]
                found = [(at, s) for at, s in found if at != -1]
                if found:
                    at, hit = min(found)
                    yield token, text[start:at] if at > start else "", "stop", hit
                    return
            yield token, piece, "length" if n == max_tokens else None, None

    async def stream(self, send, body, chat, ident, prompt_ids, gen):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        want_ids = body.get("return_token_ids")
        die_after = (body.get("fake_die_after") or {}).get(self.name)
        stream_error = body.get("fake_stream_error") or {}
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def emit(chunk: dict) -> None:
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})

        if chat:
            first = dict(ident, object=obj, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}])
            if want_ids:
                first["prompt_token_ids"] = prompt_ids
            await emit(first)
        count = 0
        async for token, piece, finish, stop_reason in gen:
            count += 1
            if chat:
                choice = {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
                if want_ids and count == 1:
                    choice["prompt_token_ids"] = prompt_ids
            if finish is not None:
                choice["stop_reason"] = stop_reason
            if want_ids:
                choice["token_ids"] = [token]
            await emit(dict(ident, object=obj, choices=[choice]))
            self.tokens_streamed += 1
            if stream_error and count >= stream_error.get("after", 0):
                status = stream_error.get("status", 400)
                await emit({"error": {"message": "fake error inside the stream", "type": "BadRequestError",
                                      "param": None, "code": status}})
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
                return
            if die_after is not None and count >= die_after:
                await asyncio.sleep(0.05)  # let the bytes leave, then die like a killed replica
                os._exit(1)
        if (body.get("stream_options") or {}).get("include_usage"):
            await emit(dict(ident, object=obj, choices=[], usage={
                "prompt_tokens": len(prompt_ids), "completion_tokens": count,
                "total_tokens": len(prompt_ids) + count}))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    @staticmethod
    async def json(send, status: int, payload) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


class FakeProcess:
    """A fake upstream running as its own process (its own GIL), for tests and benchmarks."""

    def __init__(self, name: str, token_delay: float = 0.0, port: int | None = None):
        import socket
        import subprocess
        import sys

        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, __file__, "--port", str(port), "--name", name,
                                      "--token-delay", str(token_delay)])
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = 30.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake upstream {self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"fake upstream {self.name} did not become ready")

    def received(self) -> list[dict]:
        import httpx

        return httpx.get(self.url + "/_requests", timeout=5).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args()
    uvicorn.run(Fake(args.name, args.token_delay), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False, loop="uvloop", http="httptools")


if __name__ == "__main__":
    main()
