"""Streaming replies as server-sent events, token by token as the engine samples them.

The text a client receives while streaming must be a prefix of the final
reply, which is only known at the end (a stop string cuts it; a tool call is
parsed out of it). `ReplyText` therefore holds back what could still change:
the last characters that may begin a stop string, anything from a
`<tool_call>` on when tools are offered, a trailing partial UTF-8 character.
The rest of the reply, the tool calls and the finish reason follow when the
sample is complete.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

TOOL_CALL_OPEN = "<tool_call>"


class ReplyText:
    """Incrementally decoded reply of one choice; `feed` returns the newly safe text."""

    def __init__(self, tokenizer, stop: list[str], tools: bool):
        self.tokenizer, self.stop, self.tools = tokenizer, stop, tools
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted = ""

    def feed(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        limit = len(text) - self.holdback
        if self.tools:
            start = text.find(TOOL_CALL_OPEN)
            if start >= 0:
                limit = min(limit, start)
            else:  # the end of the text may be the beginning of "<tool_call>"
                for k in range(len(TOOL_CALL_OPEN) - 1, 0, -1):
                    if text.endswith(TOOL_CALL_OPEN[:k]):
                        limit = min(limit, len(text) - k)
                        break
        safe = text[: max(limit, 0)]
        if self.tools:
            safe = safe.rstrip("\n")  # newlines before a tool call are not content
        safe = safe.rstrip("\ufffd")  # a character whose bytes are not all here yet
        if len(safe) <= len(self.emitted) or not safe.startswith(self.emitted):
            return ""
        delta, self.emitted = safe[len(self.emitted):], safe
        return delta

    def rest(self, final: str | None) -> str:
        """What is left to send of the final text."""
        final = final or ""
        if not final.startswith(self.emitted):  # cannot happen by construction; never send a wrong prefix
            raise RuntimeError("streamed text is not a prefix of the final reply")
        return final[len(self.emitted):]


@dataclass(frozen=True)
class Wire:
    """How one protocol writes a reply stream.

    `events(body, sampled)` turns the sampled pieces into the protocol's events;
    `error(api_error)` is the last event of a stream that fails after its headers
    were sent; `end` closes every stream ("" for none).
    """

    events: Callable[..., AsyncIterator[str]]
    error: Callable[..., str]
    end: str = ""


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


DONE = "data: [DONE]\n\n"
