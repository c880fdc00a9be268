"""One episode, whoever plays it, and what comes back.

A player plays an environment already made:

- `EnginePlayer`: the env runner on an engine (`runner.run_episode`); every token captured.
- `LoopbackAgent`: a `ChatAgent` whose requests the loopback serves from an engine (`agent.run_agent`);
  every token captured.
- `EndpointPlayer`: a model behind an OpenAI-compatible endpoint, played by the env runner's loop in
  messages (`endpoint.run_endpoint_episode`) or by a `ChatAgent` pointed at it; nothing captured.

`play` is the one way in: it makes the environment, gives the episode its sampling seed
(`molt_env.split.sample_seed`), bounds it by a timeout, and turns whatever the environment or the player
raises into the episode's `failure` (one line naming the exception and where it was raised, then the
innermost frames), so that a failing episode costs itself and nothing else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import traceback
from dataclasses import dataclass, field

from molt_agents.engines.base import SamplingParams
from molt_env.trajectory import Trajectory


@dataclass
class Episode:
    """A played episode: its captured segments (none from an endpoint), reward, turns and tokens (None where
    the player cannot tell), the weight versions that sampled it, its text (an endpoint's conversation; for
    captured segments, evaluation decodes the last one), its chat messages where the engine played it (the env
    runner's conversation, or an agent's last chat request and reply: what a reward model reads), or why it
    failed."""

    trajectories: list[Trajectory] = field(default_factory=list)
    reward: float = 0.0
    turns: int | None = 0
    completion_tokens: int | None = 0
    total_tokens: int | None = 0
    versions: list[int] = field(default_factory=list)
    text: str = ""
    failure: str | None = None
    messages: list[dict] | None = None

    @classmethod
    def captured(cls, trajectories: list[Trajectory]) -> Episode:
        """The episode of an engine-backed player: its numbers read off its segments."""
        if not trajectories:  # the policy sampled nothing (e.g. the prompt filled the context)
            return cls(failure="no tokens sampled")
        masks = [t.mask for t in trajectories]
        turns = trajectories[0].info.get("turns")  # the env runner counts them; for an agent, its sampled spans
        if turns is None:
            turns = sum(m and not (i and mask[i - 1]) for mask in masks for i, m in enumerate(mask))
        return cls(trajectories, float(trajectories[0].reward), int(turns), sum(map(sum, masks)),
                   sum(len(t.token_ids) for t in trajectories),
                   sorted({v for t in trajectories for v, m in zip(t.versions, t.mask) if m}))


class EnginePlayer:
    """The env runner on `engine`."""

    def __init__(self, engine, tokenizer, max_total_tokens: int, vision=None):
        self.engine, self.tokenizer, self.max_total_tokens, self.vision = engine, tokenizer, max_total_tokens, vision

    async def __call__(self, env, params: SamplingParams, *, seed, options, rollout_id, group_id) -> Episode:
        from molt_agents.runner import run_episode

        messages: list[dict] = []
        episode = Episode.captured(await run_episode(
            env, self.engine, self.tokenizer, params, max_total_tokens=self.max_total_tokens, seed=seed,
            options=options, rollout_id=rollout_id, group_id=group_id, vision=self.vision, conversation=messages))
        episode.messages = messages
        return episode


class LoopbackAgent:
    """`agent` (a `ChatAgent`) in a session of `loopback` (served on the caller's event loop)."""

    def __init__(self, agent, loopback):
        self.agent, self.loopback = agent, loopback

    async def __call__(self, env, params: SamplingParams, *, seed, options, rollout_id, group_id) -> Episode:
        from molt_agents.agent import run_agent
        from molt_env.spaces import as_messages

        await self.loopback.begin()
        observation, info = await env.areset(seed=seed, options=options)
        messages: list[dict] = []
        episode = Episode.captured(await run_agent(
            self.agent, self.loopback, messages=as_messages(observation), tools=getattr(env, "tools", None),
            sampling=request_defaults(params), task=info, rollout_id=rollout_id, group_id=group_id, env=env,
            conversation=messages))
        episode.messages = messages or None
        return episode



class EndpointPlayer:
    """`model` behind the OpenAI-compatible `base_url` (`<session>` in it becomes each episode's rollout id):
    the env runner's loop in messages, or `agent` given that URL. The loop's plays share one `openai` client
    (a client per play costs its SSL context), each on its own URL."""

    def __init__(self, base_url: str, api_key: str, model: str, max_total_tokens: int, agent=None):
        self.base_url, self.api_key, self.model = base_url, api_key, model
        self.max_total_tokens, self.agent, self.client = max_total_tokens, agent, None

    async def __call__(self, env, params: SamplingParams, *, seed, options, rollout_id, group_id) -> Episode:
        import openai

        base_url = self.base_url.replace("<session>", rollout_id)
        if self.agent is not None:
            from molt_agents.agent import AgentContext, call_agent
            from molt_env.spaces import as_messages

            observation, info = await env.areset(seed=seed, options=options)
            ctx = AgentContext(base_url=base_url, api_key=self.api_key, model=self.model,
                               messages=as_messages(observation), tools=getattr(env, "tools", None),
                               sampling=request_defaults(params), task=info, env=env)
            return Episode(reward=(await call_agent(self.agent, ctx)).reward, turns=None, completion_tokens=None,
                           total_tokens=None)
        from molt_agents.endpoint import run_endpoint_episode

        if self.client is None:
            self.client = openai.AsyncOpenAI(base_url=base_url, api_key=self.api_key)
        played = await run_endpoint_episode(env, self.client.with_options(base_url=base_url), self.model,
                                            sampling=request_defaults(params), seed=seed, options=options,
                                            max_total_tokens=self.max_total_tokens)
        return Episode(reward=played["reward"], turns=played["turns"], completion_tokens=played["completion_tokens"],
                       total_tokens=played["total_tokens"], text=json.dumps(played["messages"], ensure_ascii=False))


def request_defaults(params: SamplingParams) -> dict:
    """`params` as the fields of an OpenAI request (a loopback session's defaults, an endpoint's request)."""
    return {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_tokens,
            "seed": params.seed}


async def play(player, env_spec: str, params: SamplingParams, *, env_seed: int, group_index: int, index: int,
               options: dict, rollout_id: str, group_id: str, timeout: float, fatal: tuple = ()) -> Episode:
    """Episode `index` of group `group_index` (or evaluation episode `group_index`, play `index`) of the
    environment `env_spec` reset with `env_seed`, played by `player` within `timeout` seconds. Exceptions in
    `fatal` are not the episode's fault and propagate (an endpoint refusing the API key)."""
    import molt_env
    from molt_env.split import sample_seed

    params = dataclasses.replace(params, seed=sample_seed(params.seed, group_index, index))
    try:
        return await asyncio.wait_for(player(molt_env.make(env_spec), params, seed=env_seed, options=options,
                                             rollout_id=rollout_id, group_id=group_id), timeout)
    except asyncio.TimeoutError:  # a hung environment or agent (its thread, if any, is abandoned)
        return Episode(failure=f"timeout: the episode took over {timeout} s")
    except fatal:
        raise
    except Exception as error:  # the environment's or the player's fault: this episode only
        return Episode(failure=failure_text(error))


def failure_text(error: BaseException) -> str:
    """An episode's failure: one line naming the exception and where it was raised (file, line, function),
    then the innermost frames of its traceback."""
    message = (str(error).splitlines() or [""])[0]
    frames = traceback.extract_tb(error.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    return (f"{type(error).__name__}: {message}{where}\n"
            + "".join(traceback.format_exception(error, limit=-3)).rstrip())
