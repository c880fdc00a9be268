"""Render chat messages with the model's own chat template.

The one place where messages become text and tokens on the way into an engine,
and where a template's reasoning format (`<think>` blocks) is read off it.
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass


def render_text(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, **template_kwargs) -> str:
    """The text of `messages` (and `tools`) under the tokenizer's chat template.

    Renders are remembered per tokenizer (the last `CACHED_RENDERS`): the episodes of a group start from
    the same observation, and a template is a pure function of its input unless it reads the clock
    (`strftime_now`), whose renders are never reused. Inputs that are not JSON (images) always render."""
    try:
        key = json.dumps([messages, tools or None, add_generation_prompt, template_kwargs], sort_keys=True)
    except (TypeError, ValueError):
        key = None
    cache = _renders(tokenizer) if key is not None else None
    if cache is not None and key in cache:
        cache.move_to_end(key)
        return cache[key]
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
        **template_kwargs,
    )
    if cache is not None:
        cache[key] = text
        if len(cache) > CACHED_RENDERS:
            cache.popitem(last=False)
    return text


CACHED_RENDERS = 1024
_RENDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> OrderedDict(key -> text), or False


def _renders(tokenizer) -> OrderedDict | None:
    """The tokenizer's remembered renders; None when its template reads the clock or it cannot be remembered."""
    try:
        cache = _RENDERS.get(tokenizer)
        if cache is None:
            clock = "strftime_now" in str(getattr(tokenizer, "chat_template", None) or "")
            cache = _RENDERS[tokenizer] = False if clock else OrderedDict()
        return None if cache is False else cache
    except TypeError:  # an object that takes no weak references
        return None


def render_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                      add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
    """Token ids of `messages` (and `tools`) under the tokenizer's chat template."""
    text = render_text(tokenizer, messages, tools, add_generation_prompt, **template_kwargs)
    # The template already wrote every special token it wants; add none.
    return tokenizer.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------
# Reasoning


@dataclass(frozen=True)
class ReasoningFormat:
    """How a chat template writes an assistant turn's `reasoning_content`: `open` + reasoning + `close` + the
    reply, right after the generation prompt. Qwen3's and the tiny models' templates: "<think>\\n" and
    "\\n</think>\\n\\n"; `open` is "" where the generation prompt itself opens the reasoning."""

    open: str
    close: str

    def split(self, reply: str) -> tuple[str | None, str]:
        """`(reasoning, rest)` of a sampled reply, or `(None, reply)` if it does not begin with reasoning.

        The inverse of the template: an assistant turn with this `reasoning_content` and content re-renders
        to the very reply, so the conversation keeps stitching onto the sampled tokens. A reply cut short
        inside its reasoning (no `close`) is all reasoning. Empty reasoning stays in the text, as templates
        differ on whether they write an empty one.
        """
        if not reply.startswith(self.open):
            return None, reply
        reasoning, _, rest = reply[len(self.open):].partition(self.close)
        return (reasoning, rest) if reasoning else (None, reply)


_PROBE_REASONING, _PROBE_REPLY = "MOLT-PROBE-REASONING", "MOLT-PROBE-REPLY"


def reasoning_format(tokenizer) -> ReasoningFormat | None:
    """The chat template's reasoning format, read off one rendered assistant turn with `reasoning_content`;
    None if the template does not write it between the generation prompt and the reply."""
    ask = [{"role": "user", "content": "?"}]
    prompt = render_text(tokenizer, ask)
    turn = render_text(tokenizer, ask + [{"role": "assistant", "content": _PROBE_REPLY,
                                          "reasoning_content": _PROBE_REASONING}], add_generation_prompt=False)
    if not turn.startswith(prompt):
        return None
    open_, found, after = turn[len(prompt):].partition(_PROBE_REASONING)
    close, replied, _ = after.partition(_PROBE_REPLY)
    return ReasoningFormat(open_, close) if found and replied and close else None
