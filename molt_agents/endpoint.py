"""Play an environment against an OpenAI-compatible endpoint: a hosted model, `molt-serve`, vLLM's server.

The env runner's loop (`runner.play_turns`), in messages instead of token ids:

    observation -> chat.completions -> reply text -> env.step -> append the reply and the next observation -> ...

until the environment terminates or truncates, its turn limit, or the token
budget. Nothing is captured, so nothing here can train; it scores a model on
the same episodes as the checkpoints Molt trains (`molt-eval --base-url`).

A reply's structured tool calls reach the environment as the text the
environments parse (`tool_calls.parse_reply`'s `<tool_call>` blocks), and
the environment's tool results answer them in order under the endpoint's
own call ids.
"""

from __future__ import annotations

import json

from molt_agents.runner import play_turns


async def run_endpoint_episode(env, client, model: str, *, sampling: dict, max_total_tokens: int,
                               seed: int | None = None, options: dict | None = None) -> dict:
    """One episode of `env` played by `model` behind `client` (an `openai.AsyncOpenAI`); returns its
    reward (the sum of the step rewards), turns, completion tokens, final context tokens, whether it was
    truncated, and the conversation. `sampling`: temperature, top_p, max_tokens, seed."""
    tokens = {"completion": 0, "total": 0}

    async def turn(messages: list[dict], tools, index: int):
        budget = max_total_tokens - tokens["total"]
        if budget <= 0:
            return None
        reply = await client.chat.completions.create(
            model=model, messages=messages, temperature=sampling["temperature"], top_p=sampling["top_p"],
            max_tokens=min(sampling["max_tokens"], budget), seed=sampling.get("seed"),
            **({"tools": tools} if tools else {}))
        if reply.usage is not None:
            tokens["completion"] += reply.usage.completion_tokens
            tokens["total"] = reply.usage.prompt_tokens + reply.usage.completion_tokens
        message = reply.choices[0].message
        calls = message.tool_calls or []
        assistant = {"role": "assistant", "content": message.content or ""}
        if calls:
            assistant["tool_calls"] = [call.model_dump(exclude_none=True) for call in calls]
        return (message.content or "") + "".join(_as_text(call) for call in calls), assistant

    turns = await play_turns(env, turn, seed=seed, options=options)
    return {"reward": sum(turns.rewards), "turns": len(turns.rewards), "completion_tokens": tokens["completion"],
            "total_tokens": tokens["total"], "truncated": turns.truncated, "messages": turns.messages}


def _as_text(call) -> str:
    """A structured tool call in the `<tool_call>` form the environments parse."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        arguments = call.function.arguments
    body = json.dumps({"name": call.function.name, "arguments": arguments}, ensure_ascii=False)
    return f"\n<tool_call>\n{body}\n</tool_call>"
