"""The env runner: the framework owns the loop between an `Env` and an engine.

    observation -> chat template -> engine samples -> reply text -> env.step
        -> append only the next observation's delta after the exact sampled tokens -> ...

until the environment terminates or truncates, the turn limit, or the token
budget. The trajectory's `info` is the environment's info from its last
step (what the episode did: the trainer averages its numeric fields into
`env/*` metrics) with the runner's own `step_rewards`, `turns` and
`reset_info`; the episode return (the sum of the step rewards) is the
trajectory's reward.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from molt_agents.chat_template import render_text
from molt_agents.engines.base import SamplingParams, turn_seed
from molt_agents.multimodal import chat_images, for_template
from molt_agents.segment import Segment
from molt_env.spaces import as_messages
from molt_env.trajectory import Trajectory


@dataclass
class Turns:
    """What `play_turns` saw: each step's reward, the last step's info, whether the episode was cut short
    (truncated by the environment, its turn limit or the token budget), the reset's info, and the
    conversation with the last reply."""

    rewards: list[float]
    info: dict
    truncated: bool
    reset_info: dict
    messages: list[dict]


async def play_turns(env, turn, *, seed: int | None = None, options: dict | None = None) -> Turns:
    """The loop of every player that the framework drives: reset `env`, then ask `await turn(messages, tools,
    index)` for the `index`-th reply (its text, and the assistant message to keep; None when the token budget
    is spent), step the environment with it and append the next observation (tool results answer the
    reply's tool calls in order, under their ids), until the environment ends the episode or its turn limit
    (`max_turns`) is hit."""
    observation, reset_info = await env.areset(seed=seed, options=options)
    messages, tools, max_turns = as_messages(observation), getattr(env, "tools", None), getattr(env, "max_turns", None)
    rewards: list[float] = []
    info: dict = {}
    while True:
        played = await turn(messages, tools, len(rewards))
        if played is None:
            truncated = True
            break
        reply, assistant = played
        messages = messages + [assistant]
        observation, reward, terminated, truncated, info = await env.astep(reply)
        rewards.append(float(reward))
        if terminated or truncated:
            break
        if max_turns is not None and len(rewards) >= max_turns:
            truncated = True
            break
        messages = messages + _answering(assistant, as_messages(observation))
    return Turns(rewards, info, bool(truncated), reset_info, messages)


def _answering(assistant: dict, following: list[dict]) -> list[dict]:
    """`following` with its tool messages answering the assistant's tool calls, in order, under their ids."""
    ids = iter(call["id"] for call in assistant.get("tool_calls", ()))
    return [{**m, "tool_call_id": next(ids, m.get("tool_call_id"))} if m["role"] == "tool" else m for m in following]


async def run_episode(env, engine, tokenizer, params: SamplingParams, *, max_total_tokens: int,
                      seed: int | None = None, options: dict | None = None,
                      rollout_id: str | None = None, group_id: str = "", vision=None,
                      conversation: list | None = None) -> list[Trajectory]:
    """Play one episode of `env` with the policy behind `engine`; returns its segments.

    `vision` (a `multimodal.Vision`) lets observations carry images; `conversation`, a list, receives the
    episode's chat messages, the last reply included (what a reward model reads)."""
    segments: list[Segment] = []

    async def turn(messages: list[dict], tools, index: int):
        rendered, images = render_text(tokenizer, for_template(messages), tools), chat_images(messages)
        if not segments or not segments[-1].extend_to(rendered, images):  # the template rewrote history
            segments.append(Segment.from_text(tokenizer, rendered, vision, images))  # (or the first turn)
        segment = segments[-1]
        budget = max_total_tokens - len(segment.token_ids)
        if budget <= 0:
            return None
        turn_params = dataclasses.replace(params, n=1, max_tokens=min(params.max_tokens, budget),
                                          seed=turn_seed(params.seed, index))
        (sample,) = await engine.generate(segment.token_ids, turn_params, images=segment.prompt_images())
        segment.append_sample(sample)
        reply = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        return reply, {"role": "assistant", "content": reply}

    turns = await play_turns(env, turn, seed=seed, options=options)
    if conversation is not None:
        conversation += turns.messages
    rollout_id = rollout_id or uuid.uuid4().hex
    kept = [s for s in segments if any(s.mask)]
    info = {**turns.info, "step_rewards": turns.rewards, "turns": len(turns.rewards), "reset_info": turns.reset_info}
    return [s.to_trajectory(reward=sum(turns.rewards), rollout_id=rollout_id, group_id=group_id,
                            segment=i, num_segments=len(kept), truncated=turns.truncated, info=info)
            for i, s in enumerate(kept)]
