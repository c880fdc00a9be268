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

from molt_agents.chat_template import render_text
from molt_agents.engines.base import SamplingParams, turn_seed
from molt_agents.multimodal import chat_images, for_template
from molt_agents.segment import Segment
from molt_env.spaces import as_messages
from molt_env.trajectory import Trajectory


async def run_episode(env, engine, tokenizer, params: SamplingParams, *, max_total_tokens: int,
                      seed: int | None = None, options: dict | None = None,
                      rollout_id: str | None = None, group_id: str = "", vision=None) -> list[Trajectory]:
    """Play one episode of `env` with the policy behind `engine`; returns its segments.

    `vision` (a `multimodal.Vision`) lets observations carry images."""
    observation, reset_info = await env.areset(seed=seed, options=options)
    messages = as_messages(observation)
    tools = getattr(env, "tools", None)
    segment = Segment.from_text(tokenizer, render_text(tokenizer, for_template(messages), tools), vision,
                                chat_images(messages))
    segments = [segment]
    step_rewards: list[float] = []
    step_info: dict = {}
    truncated = False
    max_turns = getattr(env, "max_turns", None)
    while True:
        budget = max_total_tokens - len(segment.token_ids)
        if budget <= 0:
            truncated = True
            break
        turn_params = dataclasses.replace(params, n=1, max_tokens=min(params.max_tokens, budget),
                                          seed=turn_seed(params.seed, len(step_rewards)))
        (sample,) = await engine.generate(segment.token_ids, turn_params, images=segment.prompt_images())
        segment.append_sample(sample)
        reply = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        observation, reward, terminated, truncated, step_info = await env.astep(reply)
        step_rewards.append(float(reward))
        if terminated or truncated:
            break
        if max_turns is not None and len(step_rewards) >= max_turns:
            truncated = True
            break
        messages = messages + [{"role": "assistant", "content": reply}] + as_messages(observation)
        rendered, images = render_text(tokenizer, for_template(messages), tools), chat_images(messages)
        if not segment.extend_to(rendered, images):  # the template rewrote history: seal, start anew
            segment = Segment.from_text(tokenizer, rendered, vision, images)
            segments.append(segment)

    rollout_id = rollout_id or uuid.uuid4().hex
    kept = [s for s in segments if any(s.mask)]
    info = {**step_info, "step_rewards": step_rewards, "turns": len(step_rewards), "reset_info": reset_info}
    return [s.to_trajectory(reward=sum(step_rewards), rollout_id=rollout_id, group_id=group_id,
                            segment=i, num_segments=len(kept), truncated=bool(truncated), info=info)
            for i, s in enumerate(kept)]
