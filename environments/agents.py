"""Example agents: ordinary client programs that Molt trains through the loopback.

Each is what a user would write against a hosted model, pointed at the
session's base URL instead; nothing in them is Molt-specific but the context
they are handed:

    molt-train --env digit --agent environments.agents:SingleTurnChat          # openai, Chat Completions
    molt-train --env python_tool --agent environments.agents:PythonToolAgent   # openai, function calling
    molt-train --config recipes/locker.yaml --agent environments.agents:LockerAgent
    molt-train --env digit --agent environments.agents:AgentsSDKChat           # OpenAI Agents SDK (Responses)
    molt-train --env python_tool --agent environments.agents:AgentsSDKPythonTool
    molt-train --env python_tool --agent environments.agents:AnthropicPythonTool   # anthropic, tool_use

The OpenAI client and the Agents SDK take the session URL as it is
(`.../s/<session>/v1`); the anthropic SDK appends `/v1/messages` itself, so
it takes the URL without `/v1`.
"""

from __future__ import annotations

import asyncio
import json

import anthropic

from environments.python_tool import PYTHON_TOOL, final_answer, python_call
from molt_agents.agent import AgentResult, ChatAgent
from molt_env.sandbox import Sandbox


class SingleTurnChat(ChatAgent):
    """Ask the task's prompt once; the task's own reward scores the answer."""

    async def run(self, ctx):
        client = ctx.client()
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
        client = ctx.client()
        messages = list(ctx.messages)
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                         tools=ctx.tools or [PYTHON_TOOL])
            message = reply.choices[0].message
            if not message.tool_calls:
                return float(final_answer(message.content or "") == ctx.task["answer"])
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": await run_python(self.sandbox, call.function.name,
                                                             call.function.arguments)})
        return 0.0  # no answer within the turn budget


class LockerAgent(ChatAgent):
    """`locker` as an existing function-calling agent plays it: offer the task's tools, answer each call
    with the task's own tool (`Locker.call`), until the model answers in plain text, which the task
    scores; the task's facts about the episode (`Locker.facts`) go back with the reward."""

    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns

    async def run(self, ctx):
        client = ctx.client()
        messages = list(ctx.messages)
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools)
            message = reply.choices[0].message
            if not message.tool_calls:
                _, reward, _, _, facts = ctx.env.step(message.content or "")
                return AgentResult(reward, facts)
            messages.append(message.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": call.id,
                          "content": ctx.env.call(call.function.name, call.function.arguments)}
                         for call in message.tool_calls]
        return AgentResult(0.0, ctx.env.facts())  # no answer within the turn budget


async def run_python(sandbox: Sandbox, name: str, arguments: str) -> str:
    """One call of the `python` tool, off the event loop: what the code printed, or the error."""
    return (await asyncio.to_thread(python_call, sandbox, name, arguments))[0]


# --------------------------------------------------------------------------
# The OpenAI Agents SDK (`pip install openai-agents`, in the test extra), on its default model class:
# OpenAIResponsesModel, the Responses API


def responses_model(ctx):
    """The SDK's default model class on a client for this episode's session."""
    import agents

    client = ctx.client()
    return agents.OpenAIResponsesModel(model=ctx.model, openai_client=client)


def no_tracing():
    """Tracing would send each run's spans to OpenAI; a loopback run has nowhere to send them."""
    import agents

    return agents.RunConfig(tracing_disabled=True)


class AgentsSDKChat(ChatAgent):
    """An `agents.Agent` with no tools, run once on the task's prompt; the task's own reward scores
    its final output."""

    async def run(self, ctx):
        import agents

        agent = agents.Agent(name="solver", model=responses_model(ctx))
        try:
            result = await agents.Runner.run(agent, ctx.messages, run_config=no_tracing())
        except agents.ModelBehaviorError:  # e.g. the reply ran into max_output_tokens: no answer
            return 0.0
        _, reward, _, _, _ = ctx.env.step(str(result.final_output))
        return reward


class AgentsSDKPythonTool(ChatAgent):
    """`python_tool` with an `agents.Agent` that holds the task's tool as a `FunctionTool`: the SDK runs
    each call (in the sandbox) and sends its output back until the model answers in plain text."""

    def __init__(self, max_turns: int = 4):
        self.max_turns, self.sandbox = max_turns, Sandbox()

    async def run(self, ctx):
        import agents

        spec = PYTHON_TOOL["function"]

        async def python(_tool_context, arguments: str) -> str:
            return await run_python(self.sandbox, spec["name"], arguments)

        tool = agents.FunctionTool(name=spec["name"], description=spec["description"],
                                   params_json_schema=spec["parameters"], on_invoke_tool=python,
                                   strict_json_schema=False)  # the task's schema as it is
        agent = agents.Agent(name="solver", model=responses_model(ctx), tools=[tool])
        try:
            result = await agents.Runner.run(agent, ctx.messages, max_turns=self.max_turns,
                                             run_config=no_tracing())
        except (agents.MaxTurnsExceeded, agents.ModelBehaviorError):  # no answer within the budget
            return 0.0
        return float(final_answer(str(result.final_output)) == ctx.task["answer"])


# --------------------------------------------------------------------------
# The anthropic SDK (Messages API)


class AnthropicPythonTool(ChatAgent):
    """`python_tool` on the Messages API: offer the tool with its `input_schema`, answer each `tool_use`
    block with a `tool_result`, until the model answers in text or the turn budget runs out."""

    def __init__(self, max_turns: int = 4, max_tokens: int = 1024):
        self.max_turns, self.max_tokens, self.sandbox = max_turns, max_tokens, Sandbox()

    async def run(self, ctx):
        # The SDK appends /v1/messages to its base URL.
        client = anthropic.AsyncAnthropic(base_url=ctx.base_url.removesuffix("/v1"), api_key=ctx.api_key)
        tools = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                 for f in (tool["function"] for tool in ctx.tools or [PYTHON_TOOL])]
        request = {"model": ctx.model, "tools": tools,
                   "max_tokens": ctx.sampling.get("max_tokens") or self.max_tokens}  # required by the API
        system = [m["content"] for m in ctx.messages if m["role"] == "system"]
        if system:
            request["system"] = "\n".join(system)
        messages = [m for m in ctx.messages if m["role"] != "system"]
        for _ in range(self.max_turns):
            reply = await client.messages.create(messages=messages, **request)
            calls = [block for block in reply.content if block.type == "tool_use"]
            if not calls:
                text = "".join(block.text for block in reply.content if block.type == "text")
                return float(final_answer(text) == ctx.task["answer"])
            messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                              for block in reply.content]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id,
                 "content": await run_python(self.sandbox, call.name, json.dumps(call.input))} for call in calls]})
        return 0.0  # no answer within the turn budget
