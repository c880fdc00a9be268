"""Play an environment against an OpenAI-compatible endpoint: a hosted model, `molt-serve`, vLLM's server.

The env runner's loop, in messages instead of token ids:

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

from molt_env.spaces import as_messages


async def run_endpoint_episode(env, client, model: str, *, sampling: dict, max_total_tokens: int,
                               seed: int | None = None, options: dict | None = None) -> dict:
    """One episode of `env` played by `model` behind `client` (an `openai.AsyncOpenAI`); returns its
    reward (the sum of the step rewards), turns, completion tokens, final context tokens and whether it was
    truncated. `sampling`: temperature, top_p, max_tokens, seed."""
    observation, _ = await env.areset(seed=seed, options=options)
    messages = as_messages(observation)
    tools = getattr(env, "tools", None)
    max_turns = getattr(env, "max_turns", None)
    rewards, completion_tokens, total_tokens, truncated = [], 0, 0, False
    while True:
        extra = {"tools": tools} if tools else {}
        budget = max_total_tokens - total_tokens
        if budget <= 0:
            truncated = True
            break
        reply = await client.chat.completions.create(
            model=model, messages=messages, temperature=sampling["temperature"], top_p=sampling["top_p"],
            max_tokens=min(sampling["max_tokens"], budget), seed=sampling.get("seed"), **extra)
        if reply.usage is not None:
            completion_tokens += reply.usage.completion_tokens
            total_tokens = reply.usage.prompt_tokens + reply.usage.completion_tokens
        message = reply.choices[0].message
        calls = message.tool_calls or []
        text = (message.content or "") + "".join(_as_text(call) for call in calls)
        observation, reward, terminated, truncated, _ = await env.astep(text)
        rewards.append(float(reward))
        if terminated or truncated:
            break
        if max_turns is not None and len(rewards) >= max_turns:
            truncated = True
            break
        assistant = {"role": "assistant", "content": message.content or ""}
        following = as_messages(observation)
        if calls:
            assistant["tool_calls"] = [call.model_dump(exclude_none=True) for call in calls]
            answers = iter(call.id for call in calls)
            following = [{**m, "tool_call_id": next(answers, m.get("tool_call_id"))} if m["role"] == "tool" else m
                         for m in following]
        messages = messages + [assistant] + following
    return {"reward": sum(rewards), "turns": len(rewards), "completion_tokens": completion_tokens,
            "total_tokens": total_tokens, "truncated": bool(truncated)}


def _as_text(call) -> str:
    """A structured tool call in the `<tool_call>` form the environments parse."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        arguments = call.function.arguments
    body = json.dumps({"name": call.function.name, "arguments": arguments}, ensure_ascii=False)
    return f"\n<tool_call>\n{body}\n</tool_call>"
