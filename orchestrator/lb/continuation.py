"""Continuing a client's token stream on another replica when its replica goes away.

The load balancer (orchestrator.lb.proxy) plans every streamed completion with `plan_stream` and
runs a continuable one through a `Splice`, which knows the prompt's token ids and every id
streamed so far. When the stream breaks or is cut for a migration, the request goes on elsewhere:
RESUME sends prompt + generated ids to /v1/completions with the remaining budget (greedy decoding
continues token for token; the new replica loads the prefix's KV from the shard stores); REPLAY
sends the original request again, checks the tokens the client already has and skips them
(seeded sampling, output penalties, structured output). Requests neither can continue pass
through. Stop strings of continuable requests are matched here, across seams. `new_seam_id` and
`seam_id_in` name continuation requests for the migrator. docs/preemption.md has the rules, where
a seam goes, and what each kind of request is guaranteed.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass

from orchestrator.lb.sse import DONE, sse_event

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# A continuation request's X-Request-Id. vLLM builds its own request id around it
# ("cmpl-seam-<hex>-0-<suffix>"), so the KV connector's record of that request can be found.
SEAM_ID_HEADER = "X-Request-Id"
_SEAM_ID = re.compile(r"seam-[0-9a-f]{32}")


def new_seam_id() -> str:
    return f"seam-{uuid.uuid4().hex}"


def seam_id_in(request_id: str) -> str | None:
    """The seam id a replica's request id carries, or None for a request that is no continuation."""
    found = _SEAM_ID.search(request_id)
    return found.group(0) if found else None


class Mode(enum.Enum):
    RESUME = "resume"
    REPLAY = "replay"
    NONE = "none"


class SeamMismatch(Exception):
    """A replay produced a token other than the one the client already has."""


class UpstreamStreamError(Exception):
    """A replica reported an error inside its stream (an `error` event); `error` is its payload."""

    def __init__(self, error: object):
        super().__init__(str(error))
        self.error = error


# Parameters a RESUME carries over unchanged: none depends on what was generated before the seam.
RESUME_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "user",
    "priority", "truncate_prompt_tokens",
)
# State that lives in the sampler and restarts with a new request: continue by replaying.
_REPLAY_KEYS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "bad_words")
_PENALTIES = ("presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class StreamPlan:
    """What the LB decided, once per request, about continuing a client's stream."""

    path: str
    body: dict
    mode: Mode
    reason: str
    want_token_ids: bool
    stop: tuple[str, ...]
    include_stop: bool
    include_usage: bool
    continuous_usage: bool
    min_tokens: int
    max_tokens: int | None
    greedy: bool

    @property
    def chat(self) -> bool:
        return self.path == CHAT


def _single_prompt(prompt: object) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return True
        return len(prompt) == 1 and isinstance(prompt[0], (str, list))
    return False


def _choose_mode(path: str, body: dict) -> tuple[Mode, str]:
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1 or body.get("use_beam_search"):
        return Mode.NONE, "several choices"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return Mode.NONE, "logprobs"
    if body.get("echo") or body.get("suffix"):
        return Mode.NONE, "echo/suffix"
    if path == CHAT and (body.get("tools") or body.get("functions")):
        return Mode.NONE, "tools"
    if path == COMPLETIONS and not _single_prompt(body.get("prompt")):
        return Mode.NONE, "several prompts"
    if any(body.get(k) for k in _PENALTIES):
        return Mode.REPLAY, "output penalties"
    fmt = body.get("response_format")
    if any(body.get(k) for k in _REPLAY_KEYS if k != "response_format") or (
            isinstance(fmt, dict) and fmt.get("type") not in (None, "text")):
        return Mode.REPLAY, "structured output"
    greedy = body.get("temperature") is not None and float(body["temperature"]) < 1e-5
    if body.get("seed") is not None and not greedy:
        return Mode.REPLAY, "seeded sampling"
    return Mode.RESUME, "greedy" if greedy else "unseeded sampling"


def plan_stream(path: str, body: dict) -> StreamPlan:
    """How a streamed request to `path` is continued, and what its stream must honour. Raises
    ValueError or TypeError for a temperature or min_tokens that is not a number."""
    mode, reason = _choose_mode(path, body)
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(s for s in stop if s)
    options = body.get("stream_options") or {}
    max_tokens = body.get("max_completion_tokens") if path == CHAT else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    return StreamPlan(
        path=path, body=body, mode=mode, reason=reason,
        want_token_ids=bool(body.get("return_token_ids")),
        stop=stop, include_stop=bool(body.get("include_stop_str_in_output")),
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("include_usage") and options.get("continuous_usage_stats")),
        min_tokens=int(body.get("min_tokens") or 0), max_tokens=max_tokens, greedy=reason == "greedy",
    )


class StopMatcher:
    """Stop strings over text arriving in pieces, with vLLM's rules (earliest end wins, ties
    by list order) and its hold-back of text that could still become a stop string."""

    def __init__(self, stops: tuple[str, ...], include: bool):
        self.stops = stops
        self.include = include
        self.hold = 0 if include or not stops else max(len(s) for s in stops) - 1
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str, check: bool) -> tuple[str, str | None]:
        """Text now safe to forward, and the stop string matched (the stream ends there)."""
        self.text += delta
        if check and delta and self.stops:
            best = None
            for stop in self.stops:
                at = self.text.find(stop, max(0, len(self.text) - len(delta) - len(stop) + 1))
                if at != -1 and (best is None or at + len(stop) < best[0] + len(best[1])):
                    best = (at, stop)
            if best is not None:
                end = best[0] + len(best[1]) if self.include else best[0]
                out = self.text[self.emitted:end]
                self.emitted = max(self.emitted, end)
                return out, best[1]
        end = len(self.text) - self.hold
        if end <= self.emitted:
            return "", None
        out, self.emitted = self.text[self.emitted:end], end
        return out, None

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out


class Splice:
    """One client stream across any number of upstream segments (RESUME/REPLAY plans).

    `next_request()` says what to send for the next segment; `on_data()` turns each upstream
    SSE payload into the client's events; `finished` says the client stream is complete.
    """

    def __init__(self, plan: StreamPlan):
        self.plan = plan
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.upstream_text = ""  # text of `generated` as the replicas streamed it
        self.stop = StopMatcher(plan.stop, plan.include_stop)
        self.ident: tuple[object, object, object] | None = None  # original id, created, model
        self.role_sent = False
        self.finished = False
        self.segments = 0
        self.replaying = False
        self.replay_pos = 0  # tokens of `generated` the current replay has reproduced
        self.replay_text = ""
        self.replay_base = 0  # length of upstream_text where the replay started
        self.replay_start = 0
        self.replay_failed = False  # a full replay diverged: resume from ids from now on
        self.tail_failed = False  # regenerating the held-back tail diverged: keep it in the prompt
        self.clean_len = 0  # tokens up to the last chunk that released text
        self.tokens_at_seam: int | None = None  # set between a seam and the first token after it

    # -- what to send -------------------------------------------------------------------------
    def first_body(self) -> dict:
        body = {k: v for k, v in self.plan.body.items() if k not in ("stop", "stream_options")}
        body["return_token_ids"] = True
        return body

    def next_request(self) -> tuple[str, dict, Mode | None]:
        """(path, body, continuation mode or None for the first segment / a restart)."""
        self.segments += 1
        self.replaying = False
        if self.prompt_ids is None:  # nothing of the first segment arrived: start over
            return self.plan.path, self.first_body(), None
        if self.plan.mode is Mode.REPLAY and not self.replay_failed:
            self._replay_from(0)
            return self.plan.path, self.first_body(), Mode.REPLAY
        seam = len(self.generated)
        if self.clean_len < seam and not self.tail_failed:
            if self.plan.greedy:
                seam = self.clean_len
                self._replay_from(seam)
            elif not self.plan.want_token_ids:  # the client saw nothing of these tokens
                del self.generated[self.clean_len:]
                seam = self.clean_len
        return COMPLETIONS, self.resume_body(seam), Mode.RESUME

    def _replay_from(self, position: int) -> None:
        """Expect the next segment to reproduce generated[position:] first (checked, not sent)."""
        self.replaying, self.replay_pos, self.replay_text = True, position, ""
        self.replay_start = position
        # Tokens after `position` released no text (the seam sits after the last one that did),
        # so the replay's text lines up with what the client has from `position` on.
        self.replay_base = len(self.upstream_text) if position else 0

    def replay_diverged(self) -> None:
        """The last replay gave another token than the client has: resume from ids instead."""
        if self.replay_start == 0 and self.plan.mode is Mode.REPLAY:
            self.replay_failed = True
        else:
            self.tail_failed = True

    def resume_body(self, seam: int | None = None) -> dict:
        """A /v1/completions request continuing after the first `seam` generated tokens."""
        seam = len(self.generated) if seam is None else seam
        src = self.plan.body
        body = {k: src[k] for k in RESUME_KEYS if k in src}
        if src.get("seed") is not None:  # only reached after a failed replay: keep it reproducible
            body["seed"] = src["seed"] + seam
        body.update(model=src.get("model") or (self.ident[2] if self.ident else None),
                    prompt=self.prompt_ids + self.generated[:seam], stream=True, return_token_ids=True)
        if self.plan.max_tokens is not None:
            body["max_tokens"] = self.plan.max_tokens - seam
        if self.plan.min_tokens:
            body["min_tokens"] = max(0, self.plan.min_tokens - seam)
        return body

    def begin_seam(self) -> None:
        self.tokens_at_seam = len(self.generated)

    def continuable(self) -> bool:
        """False when a seam cannot be bridged: the client has output but the replica never
        said which token ids it was (a vLLM without `return_token_ids`)."""
        seen = self.role_sent or self.generated or self.upstream_text
        return self.prompt_ids is not None or not seen

    def budget_spent(self) -> bool:
        return self.plan.max_tokens is not None and len(self.generated) >= self.plan.max_tokens

    # -- what the client gets -----------------------------------------------------------------
    def on_data(self, data: bytes) -> tuple[list[bytes], int]:
        """The client's events for one upstream payload, and how many new tokens it carried.
        Raises UpstreamStreamError for an error event, SeamMismatch when a replay gives another
        token than the client has (or ends before catching up), ValueError for a payload that
        is not JSON."""
        if data == DONE or self.finished:
            return [], 0
        chunk = json.loads(data)
        if "error" in chunk and not chunk.get("choices"):
            raise UpstreamStreamError(chunk["error"])
        if self.ident is None:
            self.ident = (chunk.get("id"), chunk.get("created"), chunk.get("model"))
        choices = chunk.get("choices")
        if not choices:
            return [], 0  # a usage-only chunk: usage is counted here, across segments
        choice = choices[0]
        prompt_ids = chunk.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if prompt_ids is not None and self.prompt_ids is None:
            self.prompt_ids = list(prompt_ids)
        out = []
        if self.plan.chat and not self.role_sent:
            out.append(self._role_chunk())
        if "text" in choice:
            text = choice["text"] or ""
        else:
            text = (choice.get("delta") or {}).get("content") or ""
        ids = choice.get("token_ids") or []
        finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        if self.replaying:
            ids, text = self._skip_replayed(ids, text, finish)
        if not (ids or text or finish):
            return out, 0
        self.generated.extend(ids)
        self.upstream_text += text
        if text:
            self.clean_len = len(self.generated)
        emit, matched = self.stop.feed(text, check=len(self.generated) > self.plan.min_tokens)
        if matched is not None:
            finish, stop_reason = "stop", matched
        elif finish is not None:
            emit += self.stop.flush()
        if emit or finish is not None or (ids and self.plan.want_token_ids):
            out.append(self._chunk(emit, ids, finish, stop_reason))
        if finish is not None:
            self.finished = True
            if self.plan.include_usage:
                out.append(self._usage_chunk())
        return out, len(ids)

    def finish_locally(self, reason: str = "length") -> list[bytes]:
        """End the client stream without another replica (the token budget is already spent)."""
        self.finished = True
        out = [self._chunk(self.stop.flush(), [], reason, None)]
        if self.plan.include_usage:
            out.append(self._usage_chunk())
        return out

    def _skip_replayed(self, ids: list[int], text: str, finish: str | None) -> tuple[list[int], str]:
        fresh = []
        for token in ids:
            if self.replay_pos < len(self.generated):
                if token != self.generated[self.replay_pos]:
                    raise SeamMismatch(f"replay gave token {token} at position {self.replay_pos}, "
                                       f"the client has {self.generated[self.replay_pos]}")
                self.replay_pos += 1
            else:
                fresh.append(token)
        self.replay_text += text
        sent = len(self.upstream_text) - self.replay_base  # text the client has from this stretch
        fresh_text = self.replay_text[sent:] if len(self.replay_text) > sent else ""
        caught_up = self.replay_pos == len(self.generated) and len(self.replay_text) >= sent
        if caught_up:
            self.replaying = False
        elif finish is not None:
            raise SeamMismatch(f"replay finished ({finish}) after {self.replay_pos} of "
                               f"{len(self.generated)} tokens")
        return fresh, fresh_text

    def _usage(self) -> dict:
        prompt = len(self.prompt_ids or ())
        return {"prompt_tokens": prompt, "completion_tokens": len(self.generated),
                "total_tokens": prompt + len(self.generated)}

    def _envelope(self, choices: list) -> dict:
        ident = self.ident or (None, None, self.plan.body.get("model"))
        return {"id": ident[0], "object": "chat.completion.chunk" if self.plan.chat else "text_completion",
                "created": ident[1], "model": ident[2], "choices": choices}

    def _role_chunk(self) -> bytes:
        self.role_sent = True
        chunk = self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}])
        if self.plan.want_token_ids:
            chunk["prompt_token_ids"] = self.prompt_ids
        if self.plan.continuous_usage:
            chunk["usage"] = self._usage()
        return _encode(chunk)

    def _chunk(self, text: str, ids: list[int], finish: str | None, stop_reason: object) -> bytes:
        if self.plan.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        if self.plan.want_token_ids:
            choice["token_ids"] = ids
            if not self.plan.chat and len(self.generated) == len(ids) and self.prompt_ids is not None:
                choice["prompt_token_ids"] = self.prompt_ids  # vLLM sends them with the first tokens
        chunk = self._envelope([choice])
        if self.plan.continuous_usage:
            chunk["usage"] = self._usage()
        return _encode(chunk)

    def _usage_chunk(self) -> bytes:
        chunk = self._envelope([])
        chunk["usage"] = self._usage()
        return _encode(chunk)


def _encode(chunk: dict) -> bytes:
    return sse_event(json.dumps(chunk, separators=(",", ":")).encode())
