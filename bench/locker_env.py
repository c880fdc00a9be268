"""Molt's side of the agentic benchmark: the locker task with a tool latency, for the env runner and the loopback.

    molt-train --env bench/locker_env.py:Locker100ms ...                         # Molt's env runner
    molt-train --env locker --agent bench/locker_env.py:LockerAgent100ms ...     # a stock openai agent

A tool latency is time, not CPU (`asyncio.sleep`, as a remote tool's round
trip): a reply's tool calls wait `latency` seconds, together, before the
model can read their results. The wait is left out when the model never reads
them (a reply with calls that ends the episode at its last turn), as TRL never
runs those calls (its `max_tool_calling_iterations`). One class per latency,
since `--env` and `--agent` name a class and take no arguments.
"""

from __future__ import annotations

import asyncio

from environments.agents import LockerAgent
from environments.locker import Locker
from molt_agents.tool_calls import parse_reply


class LatencyLocker(Locker):
    """`Locker` whose tool calls take `latency` seconds: on the event loop (`astep`), so episodes overlap
    their waits (a sleep in `step` would hold one of the default thread pool's few threads)."""

    latency = 0.0

    async def astep(self, action: str):
        _, calls = parse_reply(action)
        if calls and self.latency and self.turns + 1 < self.max_turns:
            await asyncio.sleep(self.latency)
        return await super().astep(action)


class Locker0ms(LatencyLocker):
    latency = 0.0


class Locker100ms(LatencyLocker):
    latency = 0.1


class LatencyLockerAgent(LockerAgent):
    """`LockerAgent` (the stock `openai` client) whose tool calls take `latency` seconds: the request that
    sends their results waits that long first, so the calls of the last turn, whose results are never sent,
    do not wait (as in `LatencyLocker`)."""

    latency = 0.0

    async def run(self, ctx):
        if self.latency:
            client = ctx.client

            def slow_client():
                return _ToolLatencyClient(client(), self.latency)

            ctx.client = slow_client  # this episode's context only
        return await super().run(ctx)


class _ToolLatencyClient:
    """The part of an `openai.AsyncOpenAI` that LockerAgent uses, `chat.completions.create`, waiting
    `latency` seconds before a request whose last message is a tool result."""

    def __init__(self, client, latency: float):
        self.client, self.latency = client, latency
        self.chat = self.completions = self

    async def create(self, **request):
        if request["messages"][-1]["role"] == "tool":
            await asyncio.sleep(self.latency)
        return await self.client.chat.completions.create(**request)


class LockerAgent0ms(LatencyLockerAgent):
    latency = 0.0


class LockerAgent100ms(LatencyLockerAgent):
    latency = 0.1
