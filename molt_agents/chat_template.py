"""Render chat messages with the model's own chat template.

The one place where messages become text and tokens on the way into an engine,
and where a template's reasoning format (`<think>` blocks) is read off it.
"""

from __future__ import annotations

from dataclasses import dataclass


def render_text(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, **template_kwargs) -> str:
    """The text of `messages` (and `tools`) under the tokenizer's chat template."""
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
        **template_kwargs,
    )


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
