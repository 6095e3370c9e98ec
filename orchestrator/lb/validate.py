"""What the load balancer checks in a completion request before it sends it anywhere.

The LB reads some request fields itself: to plan a stream's continuation (orchestrator.lb.continuation:
the token budget, stop strings, sampling mode, seed, usage options) and to choose how to route it.
`parse_request` checks exactly those fields, with vLLM's types and rules (pydantic, lax as vLLM's
own request models: "5" is 5, "x" is an error), the same way for streamed and unary requests, and
returns the body with those fields normalized; every other field is the replica's to judge. A
missing `model` is left out, as vLLM defaults it to its served model (and a continuation takes the
model the first chunk named). Each refusal is a `BadRequest` that the proxy answers with an
OpenAI-shaped 400 naming the field. `upstream_error` reads the status of an error a replica sent
inside a stream. Called by orchestrator.lb.proxy.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_INT64 = Field(ge=-(2**63), le=2**63 - 1)


class BadRequest(Exception):
    """A request the LB refuses (400); `param` names the field, when one is to blame."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


_TokenIds = list[Annotated[int, Field(ge=0)]]


class _Common(_Model):
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    use_beam_search: bool | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    seed: Annotated[int, _INT64] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    echo: bool | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None

    def budget(self) -> int | None:
        return self.max_tokens

    @model_validator(mode="after")
    def _min_within_max(self):
        budget = self.budget()
        if self.min_tokens and budget is not None and self.min_tokens > budget:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most the token budget ({budget})")
        return self


class _Completion(_Common):
    prompt: str | list[str] | _TokenIds | list[_TokenIds] | None = None
    suffix: str | None = None


class _Message(_Model):
    role: str


class _Chat(_Common):
    messages: list[_Message]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None

    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_MODELS = {"/v1/completions": _Completion, "/v1/chat/completions": _Chat}
# Fields the LB itself reads: these are put back into the body normalized.
_READ = tuple(name for name in _Chat.model_fields if name not in ("messages",)) + ("prompt", "suffix")


def _refuse_constant(name: str) -> float:
    raise BadRequest(f"request body is not valid JSON: {name} is not a JSON number")


def parse_request(path: str, raw: bytes) -> dict:
    """The request body of a completion route, its LB-read fields normalized. Raises
    BadRequest for a body that is not a JSON object or a field the LB reads that is invalid."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        checked = _MODELS[path].model_validate(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where, message = _field_path(first["loc"]), first["msg"].removeprefix("Value error, ")
        raise BadRequest(f"{where}: {message}" if where else message,
                         param=str(first["loc"][0]) if first["loc"] else None) from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    for name in _READ:
        if name in body and name in checked.model_fields_set:
            value = getattr(checked, name)
            body[name] = value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
    return body


_TYPE_LABELS = {"int", "str", "float", "bool", "dict", "list", "none"}


def _field_path(loc: tuple) -> str:
    """'messages[0].role' from pydantic's location, without the labels of union branches."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_LABELS:
            out += f".{part}" if out else part
    return out


def upstream_error(error: object) -> tuple[int, bytes]:
    """The HTTP status and OpenAI-shaped body of an error a replica sent inside a stream
    (`{"error": {...}}`); 502 when the error names no HTTP error status."""
    code = error.get("code") if isinstance(error, dict) else None
    try:
        status = int(code)
    except (TypeError, ValueError):
        status = 502
    if not 400 <= status <= 599:
        status = 502
    if isinstance(error, dict):
        payload = {"error": {"message": str(error.get("message", "")), "type": error.get("type") or "server_error",
                             "param": error.get("param"), "code": status}}
    else:
        payload = {"error": {"message": str(error), "type": "server_error", "param": None, "code": status}}
    return status, json.dumps(payload).encode()
