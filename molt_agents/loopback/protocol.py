"""The OpenAI wire format as the loopback speaks it: requests, errors, response pieces.

Requests are validated here, before anything reaches a session or the
engine; every rejection is an `APIError` that becomes an OpenAI-style error
body (`{"error": {"message", "type", "param", "code"}}`) with a 4xx status.
A body is strict JSON (no NaN or Infinity, no lone UTF-16 surrogate) nested at
most `MAX_NESTING` levels; integers are bounded where the engine bounds them.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from molt_env.spaces import is_message

MAX_NESTING = 64  # levels of arrays and objects in a request body; far beyond any real request
# Seeds as vLLM's own server takes them; the engine seeds choice i with seed + i, which torch still takes.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1  # vLLM keeps top_k in an int32 tensor (a top_k beyond the vocabulary means all of it)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Parameters clients send that do not change what the policy samples.
IGNORED_PARAMS = {"user", "metadata", "store", "parallel_tool_calls", "service_tier", "stream_options"}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)  # any size: the loopback caps it at the context room left
    temperature: float | None = Field(None, ge=0, le=2)  # vLLM's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def check(self) -> None:
        """What the field types cannot say: parameters the loopback refuses, fields that constrain each other."""
        for name in self.model_extra or {}:
            if name not in IGNORED_PARAMS:
                raise APIError(400, f"unsupported parameter '{name}'", param=name, code="unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"'{name}' must be 0: the policy's sampling distribution is not penalised",
                               param=name, code="unsupported_parameter")
        if "" in self.stop_list:
            raise APIError(400, "invalid 'stop': a stop string must not be empty", param="stop")

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages):
        for i, message in enumerate(messages):
            if not is_message(message):
                raise ValueError(f"messages[{i}] is not a chat message with a known role and content")
        return messages

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools):
        for i, tool in enumerate(tools or []):
            if tool.get("type") != "function" or not isinstance(tool.get("function", {}).get("name"), str):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        return tools

    def check(self) -> None:
        super().check()
        if self.tool_choice not in (None, "auto", "none"):
            raise APIError(400, "tool_choice must be 'auto' or 'none': forcing a call would constrain "
                                "the policy's sampling", param="tool_choice", code="unsupported_parameter")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "only response_format {'type': 'text'} is supported: structured output "
                                "would constrain the policy's sampling", param="response_format",
                           code="unsupported_parameter")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        for name in ("echo", "suffix", "best_of"):
            if getattr(self, name) not in (None, False, 1):
                raise APIError(400, f"unsupported parameter '{name}'", param=name, code="unsupported_parameter")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "prompt is empty", param="prompt")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens


class FinishRequest(BaseModel):
    """`POST /s/<session>/finish`: a misspelled key is refused, not silently dropped with its value."""

    model_config = ConfigDict(extra="forbid")

    reward: float = Field(strict=True, allow_inf_nan=False)  # strict: true and "1" are not rewards
    info: dict[str, Any] | None = None


def decode(body: bytes) -> Any:
    """The JSON value of a request body, or an `APIError` saying what is wrong with it."""
    try:
        payload = json.loads(body, parse_constant=_not_json)
    except RecursionError:  # nested past what Python's parser can recurse
        raise _too_deep() from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, _not_json
        raise APIError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    if _nesting_exceeds(payload, MAX_NESTING):
        raise _too_deep()
    try:  # a string the tokenizer cannot take, and that no error message could quote
        json.dumps(payload, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError(400, "the request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                            "escape), which is not a character", code="invalid_json") from None
    return payload


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON value")


def _too_deep() -> APIError:
    return APIError(400, f"the request body is nested more than {MAX_NESTING} levels deep", code="invalid_json")


def _nesting_exceeds(payload: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels deep in `payload` (level by level, no recursion)."""
    level = [payload]
    for _ in range(limit + 1):
        containers = [node for node in level if isinstance(node, (dict, list))]
        if not containers:
            return False
        level = [child for node in containers for child in (node.values() if isinstance(node, dict) else node)]
    return True


Body = TypeVar("Body", bound=BaseModel)


def parse(model: type[Body], payload: Any) -> Body:
    """Validate a decoded JSON body into `model`, or raise an `APIError` naming the field."""
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(payload)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"invalid '{param}': {first['msg']}", param=param) from None
    if hasattr(request, "check"):
        request.check()
    return request


# --------------------------------------------------------------------------
# Response pieces


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def token_logprob(tokenizer, token: int, logprob: float, top: dict[int, float] | None) -> dict:
    """One entry of `choice.logprobs.content`."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    entry = {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}
    if top is not None:
        entry["top_logprobs"] = [
            {"token": (t := tokenizer.decode([k], skip_special_tokens=False)), "logprob": _finite(v),
             "bytes": list(t.encode())}
            for k, v in sorted(top.items(), key=lambda kv: -kv[1])
        ]
    return entry


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0  # JSON has no -inf
