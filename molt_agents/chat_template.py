"""Render chat messages with the model's own chat template.

The one place where messages become text and tokens on the way into an engine.
"""

from __future__ import annotations


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
