"""Anthropic's Messages API (`POST /v1/messages`), translated onto the loopback's chat route.

As for the Responses API (responses.py), a Messages request becomes the chat
messages and tools that Chat Completions takes (`chat_request`), and the chat
route renders, stitches and samples them; so an episode played through either
API leaves the same token-exact trajectory. `Reply` writes the chat route's
result back as a Message, or as Anthropic's event stream.

Content blocks: `text`, `image` (a base64 or URL source), `tool_use` (an
assistant's call), `tool_result` (a user's answer to one, text only) and
`thinking`; the `system` prompt is a string or text blocks. Errors take
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), the
message naming the field. Refused with a 400: a forced `tool_choice`,
`redacted_thinking` blocks (the loopback never writes them), and parameters
the loopback does not know. The model's tool-call arguments come back as the
`tool_use` block's `input`; arguments that are not a JSON object come back as
`{"arguments": <the text>}`.

Extended thinking needs a chat template with a reasoning format
(`chat_template.ReasoningFormat`, e.g. `<think>...</think>`); without one,
`thinking` and thinking blocks are refused with a 400. With one, `thinking`
`enabled` (its `budget_tokens` checked as Anthropic checks it, not enforced:
the policy's sampling is not constrained) or `adaptive` turns a reply that
begins with reasoning into a `thinking` block (the reasoning text, and the
message id as its opaque `signature`) before the text and `tool_use` blocks;
streamed as `thinking_delta`s then a `signature_delta`. A thinking block sent
back first in an assistant turn is that turn's `reasoning_content`, which the
template writes back as the reply was sampled (`ReasoningFormat.split` inverts
the template), so the next request still stitches onto the sampled tokens.
The thinking tokens are sampled tokens, captured and trained like the rest of
the reply.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from molt_agents.chat_template import ReasoningFormat
from molt_agents.loopback.protocol import APIError, ChatRequest, new_id

# Parameters clients send that do not change what the policy samples.
IGNORED_PARAMS = {"metadata", "service_tier", "cache_control"}
ROLES = ("user", "assistant")
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
NO_REASONING = "the policy's chat template has no reasoning format (such as <think>...</think>)"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def speaks(path: str) -> bool:
    """Whether a request path is one of this API's routes (its errors take Anthropic's shape)."""
    return path.endswith(("/v1/messages", "/v1/messages/count_tokens"))


def error_body(error: APIError) -> dict:
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": message}}


class Thinking(BaseModel):
    """The `thinking` parameter; `budget_tokens` as Anthropic bounds it (below `max_tokens` too)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1024)
    display: Literal["summarized"] | None = None  # "omitted" would hide the reasoning the policy samples


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: the conversation without the sampling parameters."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)  # checked block by block in `chat_messages`
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None

    def check(self) -> None:
        """What the field types cannot say: parameters the loopback refuses."""
        for name in self.model_extra or {}:
            if name not in IGNORED_PARAMS:
                raise _bad(name, f"unsupported parameter '{name}'")
        thinking = self.thinking
        if thinking is not None and (thinking.type == "enabled") != (thinking.budget_tokens is not None):
            raise _bad("thinking.budget_tokens", "required with thinking.type 'enabled', and only with it")
        if self.tool_choice is not None and self.tool_choice.get("type") not in ("auto", "none"):
            raise _bad("tool_choice", "tool_choice.type must be 'auto' or 'none': forcing a call would "
                                      "constrain the policy's sampling")

    @property
    def thinks(self) -> bool:
        """Whether the reply's reasoning comes back as a thinking block."""
        return self.thinking is not None and self.thinking.type != "disabled"


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API; the loopback caps it at the context room left
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False

    def check(self) -> None:
        super().check()
        if "" in (self.stop_sequences or []):
            raise _bad("stop_sequences", "a stop sequence must not be empty")
        if self.thinking is not None and (self.thinking.budget_tokens or 0) >= self.max_tokens:
            raise _bad("thinking.budget_tokens", "must be less than max_tokens")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"invalid '{param}': {message}" if param not in message else message, param=param)


# --------------------------------------------------------------------------
# Request -> chat


def chat_messages(body: CountTokensRequest, reasoning: ReasoningFormat | None) -> tuple[list[dict], list[dict] | None]:
    """The chat messages and tools of `body`: the system prompt, then each message's blocks. `reasoning`: the
    chat template's reasoning format, without which thinking is refused."""
    if body.thinks and reasoning is None:
        raise _bad("thinking", f"extended thinking is not supported: {NO_REASONING}; leave 'thinking' out")
    messages = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise _bad(f"{where}.role", f"a message needs a role, one of {list(ROLES)}")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
        elif not isinstance(content, list) or not content:
            raise _bad(f"{where}.content", "must be a string or a non-empty list of content blocks")
        elif message["role"] == "user":
            messages += _user(content, f"{where}.content")
        else:
            messages.append(_assistant(content, f"{where}.content", reasoning is not None))
    return messages, _tools(body.tools)


def chat_request(body: MessagesRequest, reasoning: ReasoningFormat | None) -> ChatRequest:
    """The chat request that samples what `body` asks for."""
    messages, tools = chat_messages(body, reasoning)
    return ChatRequest(messages=messages, tools=tools, tool_choice=(body.tool_choice or {}).get("type"),
                       max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                       stop=body.stop_sequences, stream=body.stream)


def _user(blocks: list, where: str) -> list[dict]:
    """A user turn: a chat `tool` message per `tool_result`, then one user message of the other blocks."""
    results, parts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str):
                raise _bad(f"{where}[{j}].tool_use_id", "must be a string")
            content = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": tool_use_id,
                            "content": content if isinstance(content, str)
                            else _text(content, f"{where}[{j}].content")})
        elif kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, f"{where}[{j}].source")}})
        else:
            raise _bad(f"{where}[{j}]", "a user content block must be text, image or tool_result")
    if not parts:
        return results
    if all(p["type"] == "text" for p in parts):  # text blocks join into one string, as vLLM joins them
        return [*results, {"role": "user", "content": "\n".join(p["text"] for p in parts)}]
    return [*results, {"role": "user", "content": parts}]


def _assistant(blocks: list, where: str, has_reasoning: bool) -> dict:
    """An assistant turn: its text, a chat tool call per `tool_use`, and a first `thinking` block as its
    `reasoning_content`."""
    texts, calls, reasoning = [], [], None
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            for key, types in (("id", str), ("name", str), ("input", dict)):
                if not isinstance(block.get(key), types):
                    raise _bad(f"{where}[{j}].{key}", f"must be {'an object' if types is dict else 'a string'}")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "thinking" and not has_reasoning:
            raise _bad(f"{where}[{j}].type", f"thinking blocks are not supported: {NO_REASONING}")
        elif kind == "thinking":
            if j or not isinstance(block.get("thinking"), str):
                raise _bad(f"{where}[{j}]", "a thinking block ({'type': 'thinking', 'thinking': <text>, "
                                            "'signature'}) must come first in an assistant turn: the chat "
                                            "template writes one reasoning before the reply")
            reasoning = block["thinking"]
        elif kind == "redacted_thinking":
            raise _bad(f"{where}[{j}].type", "redacted_thinking blocks are not supported: the loopback never "
                                             "writes them")
        else:
            raise _bad(f"{where}[{j}]", "an assistant content block must be text, tool_use or thinking")
    message = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _text(content, where: str) -> str:
    """Text blocks (or a string) as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "\n".join(b["text"] for b in content)
    raise _bad(where, "must be a string or a list of text blocks")


def _image_url(block: dict, where: str) -> str:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" \
            and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise _bad(where, "an image source must be {'type': 'base64', 'media_type', 'data'} or {'type': 'url', 'url'}")


def _tools(tools: list | None) -> list[dict] | None:
    """Anthropic's tools (`name`, `description`, `input_schema`) in the chat shape the chat template takes."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise _bad(f"tools[{i}].type", "only custom tools (name, description, input_schema) are supported: "
                                           "the loopback serves the policy only")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"tools[{i}]", "a tool needs a 'name' and an 'input_schema' object")
        function = {"name": tool["name"], "description": tool.get("description"), "parameters": tool["input_schema"]}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


# --------------------------------------------------------------------------
# Chat reply -> Message


class Reply:
    """One Messages reply: the Message, or its event stream, made from the chat route's result.

    `reasoning`: the template's reasoning format when the request asked for thinking blocks, else None.
    `input_tokens` is set once the prompt is known, before sampling (for `message_start`).
    """

    def __init__(self, model: str, reasoning: ReasoningFormat | None = None):
        self.model, self.reasoning, self.id, self.input_tokens = model, reasoning, new_id("msg"), 0

    def message(self, chat_reply: dict, stop_sequence: str | None) -> dict:
        """The Message of a chat completion with one choice; `stop_sequence`: the one that ended it, if any."""
        (choice,) = chat_reply["choices"]
        reason = "stop_sequence" if stop_sequence is not None and choice["finish_reason"] == "stop" \
            else STOP_REASONS.get(choice["finish_reason"], "end_turn")
        usage = chat_reply["usage"]
        return self._object(_content(choice["message"], self.id), reason,
                            stop_sequence if reason == "stop_sequence" else None,
                            {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]})

    def _object(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    # ------------------------------------------------------------------
    # The event stream

    @staticmethod
    def error(error: APIError) -> str:
        return _event("error", error_body(error))

    async def events(self, _chat_body, sampled):
        """`message_start`, the thinking and text blocks as they are sampled, each `tool_use` block once
        final, then `message_delta` (stop reason, usage) and `message_stop`."""
        start = self._object([], None, None, {"input_tokens": self.input_tokens, "output_tokens": 0})
        yield _event("message_start", {"message": start})
        blocks = _StreamedBlocks(self.reasoning, self.id)
        async for kind, *rest in sampled:
            if kind == "text":
                for event in blocks.feed(rest[-1]):
                    yield event
                continue
            final, _ = rest
            for event in blocks.finish(final["content"]):
                yield event
            yield _event("message_delta", {"delta": {"stop_reason": final["stop_reason"],
                                                     "stop_sequence": final["stop_sequence"]},
                                           "usage": final["usage"]})
            yield _event("message_stop", {})


class _StreamedBlocks:
    """The content blocks of one streamed reply: each thinking or text block shows, as the reply is
    sampled, what the text so far already fixes, so every delta is a prefix of the final block."""

    def __init__(self, reasoning: ReasoningFormat | None, signature: str):
        self.reasoning, self.signature = reasoning, signature
        self.text = ""  # the reply so far: what streaming.ReplyText deems safe to show
        self.shown: list[dict] = []  # each started block, with its text so far
        self.stopped = 0  # blocks before this index are closed

    def feed(self, new_text: str) -> list[str]:
        self.text += new_text
        parts = self._parts()
        events = []
        for index, (kind, text) in enumerate(parts):
            last = index == len(parts) - 1
            events += self._show(index, kind, text, start=not last)
            if not last:  # a later block began: this one is final
                events += self._stop(index)
        return events

    def finish(self, content: list[dict]) -> list[str]:
        """The rest of each block of the final `content`, and its `content_block_stop`."""
        events = []
        for index, block in enumerate(content):
            if block["type"] == "tool_use":
                self.shown.append(block)
                events.append(_event("content_block_start", {"index": index, "content_block": {**block, "input": {}}}))
                events.append(_event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
            else:
                events += self._show(index, block["type"], block[block["type"]], start=True)
            events += self._stop(index)
        return events

    def _parts(self) -> list[tuple[str, str]]:
        """`(block type, text)` of each block that the reply so far fixes."""
        fmt, text = self.reasoning, self.text
        if fmt is None or not (text.startswith(fmt.open) or fmt.open.startswith(text)):
            return [("text", text)]
        reasoning, rest = fmt.split(text)
        if reasoning is None:  # not yet known whether the reply begins with reasoning
            return []
        if fmt.close in text[len(fmt.open):]:
            return [("thinking", reasoning), ("text", rest)]
        return [("thinking", reasoning[: len(reasoning) - _overlap(reasoning, fmt.close)])]

    def _show(self, index: int, kind: str, text: str, start: bool) -> list[str]:
        """Events that bring block `index` to `text`; a block starts with its first text, or when `start`."""
        events = []
        if index == len(self.shown):
            if not (text or start):
                return events
            self.shown.append({"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {}))
            events.append(_event("content_block_start", {"index": index, "content_block": dict(self.shown[index])}))
        block = self.shown[index]
        if block["type"] != kind or not text.startswith(block[kind]):  # cannot happen by construction
            raise RuntimeError("streamed text is not a prefix of the final reply")
        if len(text) > len(block[kind]):
            delta, block[kind] = text[len(block[kind]):], text
            events.append(_event("content_block_delta", {"index": index,
                                                         "delta": {"type": f"{kind}_delta", kind: delta}}))
        return events

    def _stop(self, index: int) -> list[str]:
        """`content_block_stop`, once per block; a thinking block gets its signature just before."""
        if index < self.stopped:
            return []
        self.stopped = index + 1
        events = []
        if self.shown[index]["type"] == "thinking":
            events.append(_event("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": self.signature}}))
        return [*events, _event("content_block_stop", {"index": index})]


def _overlap(text: str, marker: str) -> int:
    """The length of the longest end of `text` that `marker` begins with (and is not all of it)."""
    return next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-k:])), 0)


def _event(kind: str, fields: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


def _content(message: dict, signature: str) -> list[dict]:
    """Content blocks of a chat reply: its reasoning, its text (unless it only calls tools or reasons), then a
    `tool_use` per call."""
    calls, reasoning = message.get("tool_calls") or [], message.get("reasoning_content")
    blocks = [] if reasoning is None else [{"type": "thinking", "thinking": reasoning, "signature": signature}]
    if message["content"] or not (calls or blocks):
        blocks.append({"type": "text", "text": message["content"] or ""})
    for call in calls:
        arguments = call["function"]["arguments"]
        try:
            tool_input = json.loads(arguments)
        except json.JSONDecodeError:
            tool_input = None
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": tool_input if isinstance(tool_input, dict) else {"arguments": arguments}})
    return blocks


def stop_sequence(text: str, stop: list[str]) -> str | None:
    """The stop sequence that ended `text` (the reply before it was cut): the earliest found."""
    found = [(text.find(s), i) for i, s in enumerate(stop) if s and s in text]
    return stop[min(found)[1]] if found else None
