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
so a slow `step` never blocks the rollout event loop. A class whose calls
prove quick (`INLINE_AFTER` calls in a row each computing under
`QUICK_SECONDS` of its thread's CPU time and done within `SLOW_SECONDS`:
CPU time, since a thread's wall time includes its waits for the GIL, which
the engine's steps hold) has the rest run on the loop itself, without a
thread's hand-offs (which cost more than such a call); one call that then
takes over `SLOW_SECONDS` sends the class back to threads, to return once
twice as many calls in a row have proved quick again (a call on the loop is
slow when the call blocks, or when the machine did not run the process for
a while: the doubling bounds what the first kind costs the loop, and the
return keeps the second from costing the class its speed for good).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
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
        return await _call(type(self), self.reset, seed=seed, options=options)

    async def astep(self, action: str):
        return await _call(type(self), self.step, action)


QUICK_SECONDS = 0.001
INLINE_AFTER = 64
SLOW_SECONDS = 0.01


@dataclass
class _Timing:
    quick_calls: int = 0  # quick calls in a row, in threads
    inline: bool = False
    returns: int = 0  # times a slow call on the loop sent the class back to threads


_TIMINGS: dict[type, _Timing] = {}


async def _call(cls: type, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, a sync method of an `Env` subclass `cls`: in a worker thread, or on the event
    loop once the class's calls have proved quick (see the module docstring)."""
    timing = _TIMINGS.setdefault(cls, _Timing())
    if timing.inline:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if time.perf_counter() - started > SLOW_SECONDS:
                timing.inline, timing.quick_calls, timing.returns = False, 0, timing.returns + 1

    def timed():
        started, computing = time.perf_counter(), time.thread_time()
        result = fn(*args, **kwargs)
        return result, time.thread_time() - computing, time.perf_counter() - started

    result, computed, took = await asyncio.to_thread(timed)
    quick = computed < QUICK_SECONDS and took < SLOW_SECONDS
    timing.quick_calls = timing.quick_calls + 1 if quick else 0
    timing.inline = timing.quick_calls >= INLINE_AFTER << timing.returns
    return result
