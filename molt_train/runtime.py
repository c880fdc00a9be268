"""The Ray runtime behind the loop: rollout workers, the trainer group, the weight sync.

Local `ray.init` by default, or `--ray.address` to join a cluster. Every
engine replica and trainer rank goes into a placement group reserved first
(`placement`); the start-up report says which node each landed on.

Weight sync (pause, load, version + 1, resume, between two engine steps):
by default the trainer broadcasts the weights in buckets on a channel of its
own to every worker (`weight_sync`: NCCL on GPU, gloo on CPU); or rank 0
gathers the whole model and it travels through Ray's object store.

Faults: a rollout worker whose process dies (killed, out of memory, a crash
in the engine) is restarted by Ray; its groups in flight are counted as lost
and generated again, and `check_workers` brings the new process up to the
current weights (also during every trainer step, ready for the weight sync
after it, which would otherwise wait on the dead process). A trainer rank that dies ends the run, which
`--resume` continues from its last checkpoint.
"""

from __future__ import annotations

import asyncio
import time

import ray

from molt_train import checkpoint
from molt_train.console import StartupError, cause
from molt_train.model_fit import model_config
from molt_train.placement import Placement
from molt_train.plan import local_cpus
from molt_train.plan.memory import cpu_kv_cache, kv_bytes_per_token
from molt_train.plan.shape import sizes
from molt_train.rollout import GroupStream, RolloutWorker, training_sampling

WORKER_RESTARTS = 4  # per worker, over the run


# A local Ray starts a Python worker process per CPU and ends those still idle a second later. The run's
# actors take them: the rollout workers at once, the trainer's ranks once the driver has imported torch
# (`Runtime.start`), a second or more later, when each would otherwise wait for a process of its own to start.
IDLE_WORKER_SECONDS = 10


def start_local_ray(num_cpus: int) -> None:
    """A new Ray instance on this machine (a new one even where `ray start` left a cluster that a bare
    `ray.init()` would join), whose idle workers wait `IDLE_WORKER_SECONDS` for the run's actors."""
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
             configure_logging=False,
             _system_config={"idle_worker_killing_time_threshold_ms": IDLE_WORKER_SECONDS * 1000})


async def _started(what: str, awaitable):
    """Await a start-up call; a failure becomes one line naming the component and the cause."""
    try:
        return await awaitable
    except Exception as error:
        raise StartupError(f"{what} failed to start: {cause(error)}") from error


async def _instance(worker, restart_timeout: float = 600.0) -> str:
    """The worker's instance id, once it is up: Ray answers "unavailable" while it restarts the
    process, and "died" for a moment after the death or for good once the restarts are used up."""
    deadline, died = asyncio.get_running_loop().time() + restart_timeout, 0
    while True:
        try:
            return await worker.instance.remote()
        except ray.exceptions.RayActorError as error:
            died += isinstance(error, ray.exceptions.ActorDiedError)
            if died > 3 or asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"a rollout worker died and was not restarted ({WORKER_RESTARTS} restarts "
                                   f"allowed): {cause(error)}") from None
            await asyncio.sleep(1.0)


def _describe(nodes: dict[str, list[str]]) -> str:
    """`placement.nodes()` in one line: which node (numbered in order of first use) each process is on."""
    numbers = {node: number for number, node in enumerate(dict.fromkeys(nodes["engines"] + nodes["trainer"]))}
    def where(ids):
        return ",".join(str(numbers[node]) for node in ids) or "-"
    return (f"engines on node {where(nodes['engines'])}, trainer ranks on node {where(nodes['trainer'])} "
            f"({len(numbers)} node(s))")


def _cpu_kv_cache(config, model_dir: str) -> int | None:
    """Bytes of a CPU engine's KV cache in this run (`plan.memory.cpu_kv_cache`); None, the engine's own
    default, for a model whose config.json lacks the sizes that need is counted from."""
    try:
        per_token = kv_bytes_per_token(sizes(model_config(model_dir)), config.engine)
    except KeyError:
        return None
    return cpu_kv_cache(per_token, config)


class Runtime:
    @classmethod
    async def start(cls, config, model_dir: str, resume_from, state: dict, console, sft: bool = False) -> Runtime:
        """Start Ray, the rollout workers and the trainer (`sft`: on the supervised loss, for `molt-sft`);
        `console.phase` reports each step of start-up, and `console.startup` gets the phases' seconds. A
        component that fails to start raises `StartupError` naming it and the cause."""
        self = cls()
        self.config, self.version, self.report = config, state["version"], console.phase
        phase, startup = console.phase, console.startup
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray and config.ray.address:
            ray.init(address=config.ray.address, include_dashboard=False, log_to_driver=True, configure_logging=False)
        elif self.owns_ray:
            start_local_ray(local_cpus(config))
        phase(f"ray: {'joined ' + config.ray.address if config.ray.address else 'started a local instance'}", "ray")
        self.placement = await Placement.reserve(config)  # a ConfigError names the flags
        phase(f"placement: {_describe(self.placement.nodes())}", "placement")
        start_dir = str(checkpoint.policy_dir(resume_from)) if resume_from else model_dir
        # Under LoRA the engines serve the run's model, and the trainer's adapters once it is up.
        lora = config.actor.lora if config.actor.lora.rank else None
        if lora:
            from molt_train.actor.lora import adapter_config  # PEFT (and torch)
        # A worker whose process dies is restarted by Ray with these arguments; `check_workers` then gives it
        # the current weights and version.
        created = time.time()
        reward_model = self._start_reward_model() if config.reward.model else None
        worker = ray.remote(max_restarts=WORKER_RESTARTS, concurrency_groups={"control": 1})(RolloutWorker)
        kv_cache = _cpu_kv_cache(config, model_dir)
        self.workers = [worker.options(**self.placement.engine(i).options()).remote(
                            model_dir if lora else start_dir, config.env, config.rollout, config.engine,
                            training_sampling(config), seed=config.seed + i, version=state["version"],
                            agent=config.agent, colocate=config.actor.colocate,
                            adapter=adapter_config(lora) if lora else None, reward=config.reward,
                            reward_model=reward_model,
                            keep_messages=config.log.rollouts or (config.log.wandb and config.log.wandb_episodes > 0),
                            cpu_kv_cache=kv_cache)
                        for i in range(config.engine.data_parallel_size)]
        # The trainer's modules import torch (about 1.5 s of CPU): imported once the rollout workers, the slowest to
        # start, are on their way, so that the driver's import overlaps their start instead of preceding Ray's.
        from molt_train.trainer import TrainerGroup
        from molt_train.trainer import rendezvous as trainer_rendezvous

        rendezvous = await _started("the trainer's rendezvous", trainer_rendezvous(self.placement))
        self.trainer = TrainerGroup(model_dir, start_dir, config, self.placement, rendezvous, sft)
        description = await _started("the trainer", self.trainer.ranks[0].describe.remote())
        startup.add("trainer", time.time() - created)
        phase(f"actor: {description}")
        if resume_from:
            await _started("the trainer's restore", self.trainer.restore(str(resume_from)))
        self.instances = await _started("a rollout worker", asyncio.gather(*(w.instance.remote()
                                                                              for w in self.workers)))
        startup.add("engines", time.time() - created)
        startup.add("trainer_init", await self.trainer.ranks[0].init_seconds.remote())
        startup.add("engine_init", max(await asyncio.gather(*(w.init_seconds.remote() for w in self.workers)),
                                       default=0.0))
        if lora:
            adapters = ray.put(await self.trainer.weights())
            await _started("the engines' adapters", asyncio.gather(*(w.load_weights.remote(adapters, self.version)
                                                                     for w in self.workers)))
        phase(f"rollout workers: {len(self.workers)} x {config.engine.name} engine", "actors")
        if config.train.weight_sync == "broadcast":
            await _started("the weight-sync channel", self._open_channel())
        phase(f"weight sync: {config.train.weight_sync}", "weight_sync")
        data = state["data"]
        self.groups = GroupStream(self.workers, config.rollout.group_size, config.rollout.groups_per_step,
                                  config.train.async_queue_size, config.seed, data["next_index"], data["redo"],
                                  recover=self.check_workers, max_extra=config.algo.max_extra_groups)
        return self

    def _start_reward_model(self):
        """The reward model's actor."""
        from molt_agents.tiny import model_dir as named_model_dir
        from molt_train.reward_model import RewardModel

        reward = self.config.reward
        actor = ray.remote(RewardModel).options(**self.placement.reward_model().options()).remote(
            str(named_model_dir(reward.model, default="reward")), reward.batch_size)
        self.report(f"reward model: {reward.model} (weight {reward.weight:g}"
                    f"{', plus the environment reward' if reward.keep_env else ', alone'})")
        return actor

    async def _open_channel(self) -> None:
        from molt_train.trainer import rendezvous as trainer_rendezvous

        host, port = await trainer_rendezvous(self.placement)
        metas = await self.trainer.ranks[0].weight_meta.remote()
        size, bucket_bytes = 1 + len(self.workers), self.config.train.sync_bucket_mb << 20
        await asyncio.gather(self.trainer.open_channel(host, port, size, bucket_bytes),
                             *(worker.open_channel.remote(host, port, 1 + i, size, metas, bucket_bytes)
                               for i, worker in enumerate(self.workers)))

    async def train_step(self, items):
        """The trainer's step on `items`; its `StepStats`. Meanwhile `check_workers` readies the workers for
        the weight sync after it: the check is a call into each worker, which a worker busy generating answers
        late, so it overlaps the step instead of delaying the sync."""
        checked = asyncio.ensure_future(self.check_workers())
        try:
            stats = await self.trainer.step(items)
        except BaseException:
            checked.cancel()
            raise
        await checked
        return stats

    async def sync_weights(self) -> int:
        """Push the trainer's weights to every engine (checked by the `train_step` before); returns the new
        policy version. `sync_bytes`: what the trainer sent (the channel's buckets, or the tensors put in the
        object store)."""
        partial = self.config.rollout.partial_rollout
        if self.config.train.weight_sync == "broadcast":
            self.sync_bytes, *versions = await asyncio.gather(self.trainer.broadcast_weights(),
                                                              *(worker.update_weights.remote(None, partial)
                                                                for worker in self.workers))
        else:
            weights = await self.trainer.weights()
            self.sync_bytes = sum(tensor.nbytes for tensor in weights.values())
            weights = ray.put(weights)
            versions = await asyncio.gather(*(worker.update_weights.remote(weights, partial)
                                              for worker in self.workers))
        self.version = versions[0]
        return self.version

    async def check_workers(self) -> None:
        """Bring workers that Ray restarted since the last check up to the run: the current weights and
        version, and (broadcast sync) a new channel, since the old one's process group held the dead
        process. Waits for a worker that is restarting; fails if one is dead for good."""
        instances = await asyncio.gather(*(_instance(worker) for worker in self.workers))
        restarted = [w for w, now, known in zip(self.workers, instances, self.instances) if now != known]
        if restarted:
            self.report(f"molt-train: {len(restarted)} rollout worker(s) died and Ray restarted them; "
                        "their groups in flight are played again")
            weights = ray.put(await self.trainer.weights())
            await asyncio.gather(*(worker.load_weights.remote(weights, self.version) for worker in restarted))
            if self.config.train.weight_sync == "broadcast":
                await self._open_channel()
        self.instances = instances

    async def sleep_engines(self) -> None:
        """Colocated: free the engines' GPU memory for the trainer's step."""
        await asyncio.gather(*(worker.sleep.remote() for worker in self.workers))

    async def wake_engines(self) -> None:
        await asyncio.gather(*(worker.wake.remote() for worker in self.workers))

    async def close(self) -> None:
        """Stop the run's processes. A Ray instance the run started ends here, and every reservation with it:
        a signal to the whole process group (`timeout`, `kill -TERM -PGID`, Slurm) stops that Ray's own
        processes too, and removing placement groups then waits on them until the driver fails (a minute,
        exit 1). On a Ray the run joined, the run's placement groups are removed."""
        try:
            await self.trainer.close()
        finally:
            for actor in self.workers + self.trainer.ranks:
                ray.kill(actor)
            if self.owns_ray:
                ray.shutdown()
            else:
                self.placement.remove()
