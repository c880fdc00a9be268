"""Rollout workers (Ray actors) and the stream of finished groups they feed.

A worker hosts one engine and plays episodes with the env runner; a group is
`group_size` episodes of the same prompt (the same environment seed). The
`GroupStream` keeps groups in flight across the workers and hands finished
ones to the trainer through a bounded queue: with `async_queue_size = 0` it
only generates what the next step consumes (synchronous, on-policy), and the
loop starts those groups as it syncs the weights of the step before
(`prefetch`), held by the engines until those weights are in; above 0
generation runs ahead of training by up to that many groups. Groups go to
a worker in chunks, a step's share of the workers at a time, in one call:
the chunk's requests reach the engine together and fill its first steps,
where one call per group would arrive staggered, each starting engine steps
of its own.

An environment that raises costs its episode, not the run: the group comes
back without it and the failure is counted. A worker whose process dies
costs the groups it was playing: they are counted as lost and played again,
on the worker Ray restarts once the runtime has brought it up to date.

With a reward model (`--reward.model`), a worker sends each finished group's
conversations to it and combines its scores into the episodes' rewards
before the group leaves the worker (`molt_train.reward_model`).

Training draws its environment seeds from `molt_env.split`'s training range;
`RolloutWorker.evaluate` plays the held-out episodes of the evaluation range
and returns only their scores (the environment's reward), which never reach
the trainer.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid

import ray

from molt_agents.engines.base import SamplingParams
from molt_agents.episode import EnginePlayer, Episode, LoopbackAgent
from molt_env.judge import serve_policy
from molt_env.split import EVAL, TRAIN, eval_seed, train_seed
from molt_train.config import EngineConfig, RewardConfig, RolloutConfig
from molt_train.group import Group


def _freeze_heap() -> None:
    """Move every object that exists now out of the cyclic collector's scans (`gc.freeze`), as vLLM's server
    does after its warm-up. Run once the worker has played its first groups: by then the modules and clients
    that an agent and the loopback create on first use exist too (the openai client, pydantic's models, the
    app), and they live as long as the process. A loopback agent's requests make many short-lived objects, and
    each full collection otherwise walked those long-lived ones again: about 95 ms, 0.8 times a step of 128
    locker episodes, on this CPU (docs/experiments/agentic-bench.md). No collection first: it would walk them
    once more, on the first step's critical path; what the first groups left as cyclic garbage stays, once."""
    gc.freeze()


class RolloutWorker:
    """One engine and the episodes it plays (run as a Ray actor)."""

    def __init__(self, model_dir: str, env: str, rollout: RolloutConfig, engine: EngineConfig,
                 sampling: SamplingParams, *, seed: int = 0, version: int = 0, agent: str | None = None,
                 colocate: bool = False, adapter: dict | None = None, reward: RewardConfig | None = None,
                 reward_model=None, keep_messages: bool = False, cpu_kv_cache: int | None = None):
        """`rollout` and `engine` as the run's config holds them (`engine.max_model_len` resolved); `sampling`
        the training episodes'; `seed` the engine's; `version` the weights' (a resumed run continues the
        count); `agent` a `ChatAgent` class that plays the episodes through the loopback; `adapter` a LoRA
        adapter's config under LoRA (the weight updates are then its adapters); `reward_model` the reward
        model's actor, which scores every training group, its scores combined as `reward` says
        (`molt_train.reward_model`); `keep_messages` puts each episode's chat messages on its trajectories,
        and an evaluation play's trajectories in its record (saved rollouts, the W&B episode table);
        `cpu_kv_cache` the bytes of a CPU engine's KV cache (`molt_train.plan.memory.cpu_kv_cache`)."""
        began = time.perf_counter()
        from transformers import AutoTokenizer

        from molt_agents.engines import make_engine
        from molt_agents.multimodal import Vision

        self.env_spec, self.rollout, self.params = env, rollout, sampling
        self.warm = False  # set once the first groups are played (`_freeze_heap`)
        self.reward, self.reward_model, self.keep_messages = reward, reward_model, keep_messages
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vision = Vision(model_dir) if Vision.available(model_dir) else None  # observations may carry images
        self.engine = make_engine(engine.name, model_dir, dtype=engine.dtype, seed=seed,
                                  max_model_len=engine.max_model_len, **engine_options(engine, colocate, cpu_kv_cache),
                                  **({"adapter": adapter} if adapter else {}))
        self.engine.version = version
        # A CPU engine steps on the episodes' event loop: a weight update is queued on it (`update_weights`)
        # and the broadcast lands in host memory; a GPU engine steps on a thread of its own, into which the
        # update streams.
        self.device = "cpu" if self.engine.stepping == "loop" else "cuda"
        self.engine_config, self.loopback = engine, None
        if agent is None:
            self.player = EnginePlayer(self.engine, self.tokenizer, rollout.max_total_tokens, self.vision)
        else:  # episodes are played by the user's agent through the loopback
            from molt_agents.loopback import Loopback
            from molt_agents.multimodal import ImageLimits
            from molt_env.registry import load_class

            self.loopback = Loopback(self.engine, self.tokenizer, max_model_len=engine.max_model_len,
                                     default_max_tokens=sampling.max_tokens, vision=self.vision,
                                     image_limits=ImageLimits(allow_remote=rollout.allow_remote_images))
            self.player = LoopbackAgent(load_class(agent)(), self.loopback)
        serve_policy(self._policy_endpoint)  # for an LLM judge that asks the policy (`molt_env.Judge`)
        self.id = uuid.uuid4().hex  # a new one when Ray restarts this worker in a new process
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.admitting = asyncio.Event()
        self.admitting.set()
        self.loading: asyncio.Future | None = None  # a weight update queued on the engine (`update_weights`)
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the episodes run on (`group`, `evaluate`)
        self._init_seconds = time.perf_counter() - began

    def init_seconds(self) -> float:
        """How long this worker's constructor took (the engine's build, mostly): `time/startup/engine_init`."""
        return self._init_seconds

    async def groups(self, chunk: list[tuple[int, int]], size: int, hold: int | None = None) -> list[Group]:
        """`group` for every `(group_index, env_seed)` of `chunk`, played at once; in that order. With `hold`,
        a weight version: their episodes start now, but the engine samples nothing before it has those
        weights (`SteppedEngine.hold`)."""
        if hold is not None:
            self.engine.hold(hold)
        groups = list(await asyncio.gather(*(self.group(index, seed, size) for index, seed in chunk)))
        if not self.warm:
            self.warm = True
            _freeze_heap()
        return groups

    async def group(self, group_index: int, env_seed: int, size: int) -> Group:
        """Play `size` episodes of the environment seeded `env_seed`; their `Trajectory` records as they are
        (Ray pickles them with their numpy routes and image tensors in place; no JSON-style copy)."""
        started = time.perf_counter()
        self.loop = asyncio.get_running_loop()
        episodes = await asyncio.gather(*(self._episode(group_index, env_seed, i) for i in range(size)))
        if self.reward_model is not None:
            await self._score(episodes)
        if self.keep_messages:
            _keep_messages(episodes)
        return Group(group_index, [t for e in episodes for t in e.trajectories],
                     [e.failure for e in episodes if e.failure is not None], time.perf_counter() - started)

    async def _score(self, episodes: list[Episode]) -> None:
        """The reward model's scores of the group's finished episodes, combined into their rewards. An agent's
        episode with no chat request to read (raw completions alone) fails."""
        from molt_train.reward_model import combine

        for episode in episodes:
            if episode.failure is None and not episode.messages:
                episode.failure = ("the reward model reads chat messages, and this episode made no chat request "
                                   "(its agent used raw completions alone)")
                episode.trajectories = []
        scored = [episode for episode in episodes if episode.failure is None]
        if scored:
            scores = await self.reward_model.score.remote([episode.messages for episode in scored])
            for episode, score in zip(scored, scores):
                combine(episode.trajectories, score, self.reward.weight, self.reward.keep_env)

    async def evaluate(self, episodes: list[int], samples: int, sampling: SamplingParams,
                       on_episode=None) -> list[dict]:
        """Play evaluation episodes `episodes` (held-out seeds), `samples` times each, sampled with `sampling`;
        one score record per play (`evaluate.episode_record`), never a trajectory to train on.
        `on_episode(record)`, for a caller in this process, is called as each one finishes."""
        from molt_train.evaluate import episode_record

        self.loop = asyncio.get_running_loop()

        async def play(episode: int, sample: int) -> dict:
            seed = eval_seed(episode)
            played = await self._episode(episode, seed, sample, EVAL, sampling)
            if played.trajectories:  # the play's text: its last context
                played.text = self.tokenizer.decode(played.trajectories[-1].token_ids)
            record = episode_record(episode, seed, sample, played)
            if self.keep_messages:
                _keep_messages([played])
                record["trajectories"] = [trajectory.to_dict() for trajectory in played.trajectories]
            if on_episode is not None:
                on_episode(record)
            return record

        return await asyncio.gather(*(play(e, s) for e in episodes for s in range(samples)))

    async def _episode(self, group_index: int, env_seed: int, index: int, split: str = TRAIN,
                       params: SamplingParams | None = None) -> Episode:
        from molt_agents.episode import play

        await self.admitting.wait()
        self.in_flight += 1
        self.idle.clear()
        try:
            rollout_id = f"{group_index}-{index}" if split == TRAIN else f"{split}-{group_index}-{index}"
            # options: for environments with data splits of their own (molt_env.split)
            return await play(self.player, self.env_spec, params or self.params, env_seed=env_seed,
                              group_index=group_index, index=index, options={"split": split}, rollout_id=rollout_id,
                              group_id=str(group_index), timeout=self.rollout.episode_timeout)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def open_channel(self, host: str, port: int, rank: int, size: int, metas, bucket_bytes: int) -> None:
        """Join the trainer's weight broadcast channel as `rank` (the rendezvous blocks, so off the loop)."""
        from molt_train.weight_sync import Channel, plan_buckets

        self.buckets = plan_buckets(metas, bucket_bytes)
        self.channel = await asyncio.to_thread(Channel, host, port, rank, size, self.device)

    @ray.method(concurrency_group="control")
    async def update_weights(self, weights: dict | None, partial_rollout: bool) -> int:
        """Load new weights: `weights` given whole, or None to receive them on the channel. With partial
        rollout, requests in flight continue under the new weights; without, new episodes wait while those
        in flight finish on the old weights.

        As a Ray actor this runs on an event loop of its own (the `control` concurrency group): a CPU engine
        steps on the episodes' loop, in turns with them, and the trainer's broadcast need not wait for a
        turn. With partial rollout on a CPU engine the weights are taken whole into host memory first, and
        the load is queued on the engine, ahead of anything asked of it later, for it to do between two
        steps: this returns, and the trainer goes on, without waiting for the engine's step in progress or
        the load (the version returned is the one the load gives). Otherwise the update runs on the
        episodes' loop; on GPU each bucket goes into the engine as it arrives (no second copy of the
        weights in GPU memory)."""
        if self.loading is not None:  # the previous update is in (its error, if any, is raised here)
            loading, self.loading = self.loading, None
            await loading
        if not partial_rollout or self.device == "cuda":
            update = self._update_weights(weights, partial_rollout)
            if self.loop is None or self.loop is asyncio.get_running_loop():
                return await update
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(update, self.loop))
        if weights is not None:
            named = list(weights.items())
        else:
            named = await asyncio.to_thread(lambda: list(self.channel.receive(self.buckets)))
        self.loading = self.engine.queue_update(named)
        return self.engine.version + 1

    async def _update_weights(self, weights: dict | None, partial_rollout: bool) -> int:
        named = list(weights.items()) if weights is not None else self.channel.receive(self.buckets)
        if partial_rollout:
            await self.engine.pause()
            try:
                return await self.engine.update_weights(named)
            finally:
                await self.engine.resume()
        self.admitting.clear()
        try:
            await self.idle.wait()
            return await self.engine.update_weights(named)
        finally:
            self.admitting.set()

    async def load_weights(self, weights: dict, version: int) -> None:
        """Bring a restarted worker up to the run: the current weights, and the version they are."""
        await self.engine.pause()  # groups Ray queued on the new process may be sampling already
        try:
            await self.engine.update_weights(list(weights.items()))
            self.engine.version = version
        finally:
            await self.engine.resume()

    async def sleep(self) -> None:
        """Free the engine's GPU memory (colocated with the trainer); nothing is in flight then."""
        await self.engine.sleep()

    async def wake(self) -> None:
        await self.engine.wake()

    @ray.method(concurrency_group="control")
    def instance(self) -> str:
        """This process's id (new when Ray restarts the worker); answered off the episodes' loop, like
        `update_weights`, so the check before each weight sync waits for no engine step."""
        return self.id

    async def _policy_endpoint(self) -> tuple[str, str, str]:
        """Where a judge reaches this worker's engine (`molt_env.judge.serve_policy`): the loopback's route
        that captures nothing, served on the episodes' loop (the agent's loopback, or one of its own)."""
        if self.loopback is None:
            from molt_agents.loopback import Loopback

            self.loopback = Loopback(self.engine, self.tokenizer, max_model_len=self.engine_config.max_model_len,
                                     vision=self.vision)
        await self.loopback.begin()
        return f"http://{self.loopback.host}:{self.loopback.port}/v1", self.loopback.api_key, "policy"

    def close(self) -> None:
        """Stop the loopback and the engine (a worker made in this process, as `molt-eval` makes one)."""
        if self.loopback is not None:
            self.loopback.stop()
        self.engine.close()


def _keep_messages(episodes: list[Episode]) -> None:
    for episode in episodes:
        for trajectory in episode.trajectories:
            trajectory.messages = episode.messages


def training_sampling(config) -> SamplingParams:
    """How a run (a `Config`) samples its training episodes."""
    rollout = config.rollout
    return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, max_tokens=rollout.max_tokens,
                          seed=config.seed)


def engine_options(engine, colocate: bool = False, cpu_kv_cache: int | None = None) -> dict:
    """The serving flags of `engine` (an EngineConfig) as the vLLM engine's arguments; none for hf.
    Colocated engines can sleep (vLLM's sleep mode, GPU only); `cpu_kv_cache` sizes a CPU engine's KV cache."""
    if engine.name != "vllm":
        return {}
    options = dict(tensor_parallel_size=engine.tensor_parallel_size, enable_expert_parallel=engine.expert_parallel,
                   gpu_memory_utilization=engine.gpu_memory_utilization,
                   enable_prefix_caching=engine.enable_prefix_caching, kv_cache_dtype=engine.kv_cache_dtype,
                   cpu_kv_cache_bytes=cpu_kv_cache)
    if engine.enforce_eager is not None:
        options["enforce_eager"] = engine.enforce_eager
    if colocate:
        options["enable_sleep_mode"] = True
    return options



class GroupStream:
    """Finished groups from the workers, in completion order, with a bounded look-ahead.

    Dynamic sampling (DAPO's, with `max_extra` > 0): a finished group whose rewards are all equal carries no
    advantage; while the step's budget of `max_extra` extra groups lasts, it is set aside and another group
    is started in its place, so that the step gets `groups_per_step` informative groups where it can. Once
    the budget is spent such groups fill the step as they come (the batch's filter drops them). The groups
    set aside are consumed (never redone on resume)."""

    def __init__(self, workers, group_size: int, groups_per_step: int, queue_size: int, seed: int,
                 next_index: int = 0, redo: list[int] | None = None, recover=None, max_extra: int = 0):
        """`recover()` is awaited when a worker died under a group: it brings restarted workers up to the run."""
        self.workers, self.group_size, self.recover, self.max_extra = workers, group_size, recover, max_extra
        self.replaced: list[Group] = []  # groups set aside by dynamic sampling, since the last `take_replaced`
        self.groups_per_step, self.queue_size, self.seed = groups_per_step, queue_size, seed
        self.next_index = next_index
        self.redo = sorted(redo or ())  # groups started but not trained before a resume
        self.in_flight: dict[asyncio.Future, list[int]] = {}  # a chunk's group indices
        self.done: list[Group] = []
        self.lost = 0  # groups whose worker died while playing them, since the last `take_lost`
        self._turn = 0
        # a step's groups in one call per worker
        self.chunk_size = max(1, -(-groups_per_step // max(len(workers), 1)))

    def env_seed(self, index: int) -> int:
        return train_seed(self.seed, index)

    def _submit(self, count: int, hold: int | None = None) -> None:
        """Start `count` groups on the next worker, in one call (sampled from weight version `hold` on)."""
        indices = []
        for _ in range(count):
            if self.redo:
                indices.append(self.redo.pop(0))
            else:
                indices.append(self.next_index)
                self.next_index += 1
        worker = self.workers[self._turn % len(self.workers)]
        self._turn += 1
        ref = worker.groups.remote([(index, self.env_seed(index)) for index in indices], self.group_size, hold)
        self.in_flight[asyncio.ensure_future(ref)] = indices

    def fill(self, held: int = 0, hold: int | None = None) -> None:
        """Keep groups in flight: this step's (less the `held` ones `take` holds already), plus the look-ahead in
        async mode; those started now sampled from weight version `hold` on."""
        while (missing := self.groups_per_step + self.queue_size - self._pending() - len(self.done) - held) > 0:
            self._submit(min(missing, self.chunk_size), hold)

    def prefetch(self, version: int) -> None:
        """Synchronous mode, as a step's weight sync begins: start the next step's groups, to be sampled by the
        weights of `version`, which that sync brings. Their episodes' work up to the first sample (environments,
        chat templates, the engines' requests) overlaps the sync, and every token is still sampled by the
        step's weights."""
        self.fill(hold=version)

    def _pending(self) -> int:
        return sum(map(len, self.in_flight.values()))

    async def take(self) -> list[Group]:
        """The next step's groups (waits for them); starts the groups that replace them."""
        self.fill()
        batch, extra = [], []
        while True:
            while self.done and len(batch) < self.groups_per_step:
                group = self.done.pop(0)
                if len(extra) < self.max_extra and len({t.reward for t in group.trajectories}) <= 1:
                    extra.append(group)
                    self._submit(1)  # in its place
                else:
                    batch.append(group)
            if len(batch) == self.groups_per_step:
                break
            finished, _ = await asyncio.wait(list(self.in_flight), return_when=asyncio.FIRST_COMPLETED)
            lost = 0
            for future in [f for f in self.in_flight if f in finished]:  # in the order they were started
                indices = self.in_flight.pop(future)
                try:
                    self.done += future.result()
                except ray.exceptions.RayActorError:  # the worker's process died: play its groups again
                    lost += len(indices)
                    self.redo = sorted([*self.redo, *indices])
            if lost:  # (its other chunks in flight fail too, and are redone the same way)
                self.lost += lost
                if self.recover is not None:
                    await self.recover()
                self.fill(len(batch))
        self.replaced += extra
        if self.queue_size:
            self.fill()  # async: the next groups generate while this step trains
        return batch

    def take_replaced(self) -> list[Group]:
        """Groups set aside by dynamic sampling since the last call."""
        replaced, self.replaced = self.replaced, []
        return replaced

    def take_lost(self) -> int:
        """Groups lost with a dead worker since the last call."""
        lost, self.lost = self.lost, 0
        return lost

    def position(self) -> dict:
        """The data position for a checkpoint: groups started but not trained are redone on resume."""
        pending = ({i for chunk in self.in_flight.values() for i in chunk} | {g.index for g in self.done}
                   | set(self.redo))
        return {"next_index": self.next_index, "redo": sorted(pending)}
