"""`Env`: a Gymnasium environment whose actions are the policy's reply text.

Write a task the way you would write any Gymnasium environment:

    class Echo(molt_env.Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.word = self.np_random.choice(["cat", "dog"])
            return f"Say {self.word}.", {}

        def step(self, action):
            reward = float(self.word in action)
            return "", reward, True, False, {}

Observations are a `str` (one user turn) or a list of chat messages; the
first observation is the prompt, every later one is what is appended to the
conversation after the policy's reply (a user turn, a tool result). Set
`tools` to offer OpenAI-style function schemas to the policy.

For I/O-bound tasks (tools, remote judges) override the async pair
`areset` / `astep`; by default they run the sync methods in a worker thread
so a slow `step` never blocks the rollout event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import gymnasium

from molt_env.spaces import Chat, Text


class Env(gymnasium.Env):
    """Base class for Molt text environments."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    observation_space = Chat()
    action_space = Text()
    tools: list[dict] | None = None  # OpenAI function schemas offered to the policy
    max_turns: int | None = None  # the runner truncates an episode after this many replies

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start an episode; returns `(observation, info)`.

        Subclasses call `super().reset(seed=seed)` first: it seeds `self.np_random`.
        """
        super().reset(seed=seed)

    def step(self, action: str):
        """Apply the policy's reply; returns `(observation, reward, terminated, truncated, info)`."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    async def areset(self, *, seed: int | None = None, options: dict | None = None):
        return await asyncio.to_thread(self.reset, seed=seed, options=options)

    async def astep(self, action: str):
        return await asyncio.to_thread(self.step, action)
