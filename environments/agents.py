"""Example agents: ordinary OpenAI-client programs that Molt trains through the loopback.

`molt-train --env digit --agent environments.agents:SingleTurnChat` plays
every episode with this agent instead of the env runner; nothing in it is
Molt-specific but the context it is handed.
"""

from __future__ import annotations

import openai

from molt_agents.agent import ChatAgent


class SingleTurnChat(ChatAgent):
    """Ask the task's prompt once; the task's own reward scores the answer."""

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, tools=ctx.tools)
        answer = reply.choices[0].message.content or ""
        _, reward, _, _, _ = ctx.env.step(answer)
        return reward
