"""OpenAI's Responses API (`POST /v1/responses`), translated onto the loopback's chat route.

A Responses request becomes the chat messages and tools that Chat Completions
takes (`chat_request`); the chat route then renders them with the model's
template, stitches them onto the session's segment and samples, exactly as it
does for a chat request. So an episode played through either API leaves the
same token-exact trajectory. `Reply` writes the chat route's result back as a
Responses object, or as the Responses event stream.

Input items: messages (`input_text`, `input_image` with a URL, `output_text`
parts), `function_call` and `function_call_output`; `instructions` become the
system turn. `previous_response_id` continues a conversation this session
produced and stored (`store`, on by default); as in OpenAI's API, the earlier
`instructions` are not carried over. Refused with a 400 naming the field:
reasoning, built-in tools (web search, file search, code interpreter, ...),
and options that would constrain the policy's sampling (a forced tool choice,
structured text formats). A function tool's `strict` flag is accepted but not
enforced: the policy samples freely and its mistakes are its own to learn from.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from molt_agents.loopback.protocol import APIError, ChatRequest, new_id, now

# Parameters clients send that do not change what the policy samples.
IGNORED_PARAMS = {"user", "parallel_tool_calls", "service_tier", "stream_options", "safety_identifier",
                  "prompt_cache_key"}
MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Any = None  # a string or a list of items: checked item by item in `conversation`
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    max_output_tokens: int | None = Field(None, ge=1)  # any size: the loopback caps it at the context room left
    temperature: float | None = Field(None, ge=0, le=2)  # vLLM's range
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None

    def check(self) -> None:
        """What the field types cannot say: parameters the loopback refuses."""
        for name in self.model_extra or {}:
            if name not in IGNORED_PARAMS:
                raise _unsupported(name, f"unsupported parameter '{name}'")
        if self.input is None:
            raise APIError(400, "'input' is required: a string or a list of input items", param="input")
        if self.tool_choice not in (None, "auto", "none"):
            raise _unsupported("tool_choice", "tool_choice must be 'auto' or 'none': forcing a call would "
                                              "constrain the policy's sampling")
        if self.text not in (None, {}, {"format": {"type": "text"}}):
            raise _unsupported("text", "only text {'format': {'type': 'text'}} is supported: structured output "
                                       "would constrain the policy's sampling")
        if self.reasoning is not None:
            raise _unsupported("reasoning", "'reasoning' is not supported: the loopback serves the policy's "
                                            "reply as sampled, with no separate reasoning items")
        if self.include:
            raise _unsupported("include", f"'include' values are not supported: {self.include}")
        if self.truncation not in (None, "disabled"):
            raise _unsupported("truncation", "truncation must be 'disabled': the loopback never drops "
                                             "conversation items on its own")


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"invalid '{param}': {message}", param=param)


# --------------------------------------------------------------------------
# Request -> chat


def conversation(body: ResponsesRequest, stored: dict[str, list[dict]]) -> list[dict]:
    """The chat messages of the conversation so far: the previous response's (from `stored`), then `input`.

    `instructions` are not part of it: each request gives its own.
    """
    history = []
    if body.previous_response_id is not None:
        if body.previous_response_id not in stored:
            raise _bad("previous_response_id", f"no stored response '{body.previous_response_id}' in this "
                                               "session (a response made with store: false is not kept)")
        history = stored[body.previous_response_id]
    if isinstance(body.input, str):
        return [*history, {"role": "user", "content": body.input}]
    if not isinstance(body.input, list):
        raise _bad("input", "must be a string or a list of input items")
    return [*history, *_messages(body.input)]


def chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatRequest:
    """The chat request that samples what `body` asks for, given the conversation's `messages`."""
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    if not messages:
        raise _bad("input", "the conversation is empty")
    return ChatRequest(messages=messages, tools=_tools(body.tools), tool_choice=body.tool_choice,
                       max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                       stream=body.stream)


def _messages(items: list) -> list[dict]:
    """Chat messages of Responses input items; consecutive function calls join the assistant turn before them."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, "an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = MESSAGE_ROLES.get(item.get("role"))
            if role is None:
                raise _bad(f"{where}.role", f"must be one of {sorted(MESSAGE_ROLES)}")
            messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, arguments, call_id = (_string(item, key, where) for key in ("name", "arguments", "call_id"))
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _content(output, f"{where}.output", images=False)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": content})
        elif kind == "reasoning":
            raise _unsupported(f"{where}.type", "reasoning items are not supported: the policy's replies "
                                                "come back as message and function_call items")
        else:
            raise _unsupported(f"{where}.type", f"input items of type '{kind}' are not supported (only message, "
                                                "function_call and function_call_output)")
    return messages


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key}", "must be a string")
    return value


def _content(content, where: str, images: bool = True) -> str | list[dict]:
    """A message's content as chat content: text parts join into one string (as vLLM joins them for
    templates that take text), images make a list of chat parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise _bad(where, "must be a string or a non-empty list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and images and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            allowed = "input_text / output_text with a 'text'" + (", input_image with an 'image_url'" * images)
            raise _bad(f"{where}[{j}]", f"a content part must be {allowed}")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _tools(tools: list | None) -> list[dict] | None:
    """Responses' flat function tools in the chat shape the chat template takes."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _unsupported(f"tools[{i}].type", f"tools of type '{kind}' are not supported: the loopback "
                                                   "serves the policy only; give the agent a function tool")
        if not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}].name", "a function tool needs a name")
        out.append({"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")
                                                      if tool.get(key) is not None}})
    return out


# --------------------------------------------------------------------------
# Chat reply -> Responses


class Reply:
    """One Responses reply: the object, or its event stream, made from the chat route's result."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id, self.message_id, self.created_at = new_id("resp"), new_id("msg"), now()
        self.sequence = 0

    def response(self, chat_reply: dict) -> dict:
        """The Responses object of a chat completion with one choice."""
        (choice,) = chat_reply["choices"]
        usage = chat_reply["usage"]
        incomplete = choice["finish_reason"] == "length"
        return self._object(
            "incomplete" if incomplete else "completed", _output(choice["message"], self.message_id),
            usage={"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": usage["total_tokens"]},
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None)

    def _object(self, status: str, output: list[dict], usage: dict | None = None,
                incomplete_details: dict | None = None) -> dict:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": incomplete_details, "instructions": body.instructions,
                "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": (body.model_extra or {}).get("parallel_tool_calls", True),
                "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id, "store": body.store,
                "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": body.metadata or {}}

    # ------------------------------------------------------------------
    # The event stream

    def error(self, error: APIError) -> str:
        return self._event("error", code=error.code or error.type, message=error.message, param=error.param)

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def events(self, _chat_body, sampled):
        """`response.created`, the text as it is sampled, each output item once final, then `response.completed`
        (`response.incomplete` when the reply hit `max_output_tokens`)."""
        yield self._event("response.created", response=self._object("in_progress", []))
        yield self._event("response.in_progress", response=self._object("in_progress", []))
        text_open = False
        async for kind, *rest in sampled:
            if kind == "text":
                text = rest[-1]
                if text and not text_open:
                    text_open = True
                    for event in self._open_message():
                        yield event
                if text:
                    yield self._event("response.output_text.delta", **self._at_text, delta=text, logprobs=[])
                continue
            final, (reply,) = rest
            for output_index, item in enumerate(final["output"]):
                if item["type"] == "message":
                    if not text_open:
                        for event in self._open_message():
                            yield event
                    (part,) = item["content"]
                    rest_text = reply.rest(part["text"])
                    if rest_text:
                        yield self._event("response.output_text.delta", **self._at_text, delta=rest_text,
                                          logprobs=[])
                    yield self._event("response.output_text.done", **self._at_text, text=part["text"], logprobs=[])
                    yield self._event("response.content_part.done", **self._at_text, part=part)
                else:
                    yield self._event("response.output_item.added", output_index=output_index,
                                      item={**item, "arguments": "", "status": "in_progress"})
                    at = {"item_id": item["id"], "output_index": output_index}
                    yield self._event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                    yield self._event("response.function_call_arguments.done", **at, name=item["name"],
                                      arguments=item["arguments"])
                yield self._event("response.output_item.done", output_index=output_index, item=item)
            yield self._event(f"response.{final['status']}", response=final)

    @property
    def _at_text(self) -> dict:
        """Where the reply's text goes: the message item, always the first output item."""
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _open_message(self) -> list[str]:
        item = {"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant", "content": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", **self._at_text,
                            part={"type": "output_text", "text": "", "annotations": []})]


def _output(message: dict, message_id: str) -> list[dict]:
    """Output items of a chat reply: its text as a `message` (unless it only calls tools), then each
    `function_call`."""
    calls = message.get("tool_calls") or []
    items = []
    if message["content"] or not calls:
        items.append({"type": "message", "id": message_id, "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message["content"] or "", "annotations": []}]})
    for call in calls:
        items.append({"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items
