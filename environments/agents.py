"""Example agents: ordinary OpenAI-client programs that Molt trains through the loopback.

`molt-train --env digit --agent environments.agents:SingleTurnChat` plays
every episode with that agent instead of the env runner, and
`molt-train --env python_tool --agent environments.agents:PythonToolAgent`
with a function-calling one; nothing in them is Molt-specific but the
context they are handed.
"""

from __future__ import annotations

import asyncio

import openai

from environments.python_tool import PYTHON_TOOL, final_answer, tool_code
from molt_agents.agent import ChatAgent
from molt_env.sandbox import Sandbox


class SingleTurnChat(ChatAgent):
    """Ask the task's prompt once; the task's own reward scores the answer."""

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, tools=ctx.tools)
        answer = reply.choices[0].message.content or ""
        _, reward, _, _, _ = ctx.env.step(answer)
        return reward


class PythonToolAgent(ChatAgent):
    """Solve `python_tool` as an existing function-calling agent would: offer the tool, run each call it
    makes in a sandbox, send the result back as a tool message, until the model answers in plain text."""

    def __init__(self, max_turns: int = 4):
        self.max_turns, self.sandbox = max_turns, Sandbox()

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        messages = list(ctx.messages)
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                         tools=ctx.tools or [PYTHON_TOOL])
            message = reply.choices[0].message
            if not message.tool_calls:
                return float(final_answer(message.content or "") == ctx.task["answer"])
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": await self._run(call.function)})
        return 0.0  # no answer within the turn budget

    async def _run(self, function) -> str:
        if function.name != "python":
            return f"[error] unknown tool {function.name!r}"
        try:
            code = tool_code(function.arguments)
        except ValueError as error:
            return f"[error] {error}"
        return (await asyncio.to_thread(self.sandbox.run, code)).message()
