"""Gymnasium spaces for text actions and chat observations.

`gymnasium.spaces.Text` only admits a fixed character set (alphanumerics by
default), but a policy's reply is arbitrary Unicode and an observation may be
a list of chat messages. These spaces accept exactly that, and sample
reproducibly from their seeded `np_random`, so `check_env` can test a text
environment's determinism.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

_SAMPLE_ALPHABET = list("abcdefghijklmnopqrstuvwxyz0123456789 .,!?+-*=()")
ROLES = ("system", "user", "assistant", "tool")


class _Sized(spaces.Space):
    """A space of values bounded by `max_length` characters, which has no numpy form."""

    def __init__(self, max_length: int, dtype, seed: int | np.random.Generator | None = None):
        super().__init__(dtype=dtype, seed=seed)
        self.max_length = max_length

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_length={self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and other.max_length == self.max_length


class Text(_Sized):
    """Any `str` up to `max_length` characters."""

    def __init__(self, max_length: int = 1_000_000, seed: int | np.random.Generator | None = None):
        super().__init__(max_length, str, seed)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        length = int(self.np_random.integers(1, min(self.max_length, 32) + 1))
        return "".join(self.np_random.choice(_SAMPLE_ALPHABET, size=length))

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length


def is_message(x: Any) -> bool:
    """A chat message: a dict with a known `role` and `content` that is text or a list of parts."""
    if not isinstance(x, dict) or x.get("role") not in ROLES:
        return False
    content = x.get("content")
    if content is None:
        return x["role"] == "assistant" and bool(x.get("tool_calls"))
    if isinstance(content, str):
        return True
    # Content parts: {"type": "text", "text": ...}, {"type": "image_url", ...}
    return isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content)


class Chat(_Sized):
    """An observation: a `str` (one user turn) or a list of chat messages."""

    def __init__(self, max_length: int = 1_000_000, seed: int | np.random.Generator | None = None):
        self.text = Text(max_length)
        super().__init__(max_length, object, seed)

    def seed(self, seed: int | None = None):
        seeds = super().seed(seed)
        self.text.seed(int(self.np_random.integers(2**31)))
        return seeds

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict]:
        return [{"role": "user", "content": self.text.sample()}]

    def contains(self, x: Any) -> bool:
        if isinstance(x, str):
            return self.text.contains(x)
        return isinstance(x, list) and all(is_message(m) for m in x)


def as_messages(observation: Any) -> list[dict]:
    """An observation as chat messages: a `str` becomes one user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, list) and all(is_message(m) for m in observation):
        return list(observation)
    raise TypeError(
        "an observation must be a str or a list of chat messages "
        f"({{'role': one of {ROLES}, 'content': ...}}), got {observation!r:.200}"
    )
