"""The Ray runtime behind the loop: rollout workers, the trainer group, the weight sync.

Local `ray.init` by default, or `--ray.address` to join a cluster. Actors ask
for no CPUs (the engine and the trainer ranks share the machine; placement
is explicit through `engine.workers` and `actor.world_size`).

Weight sync: rank 0 gathers the full weights and every worker loads them
between two engine steps (pause, load, version + 1, resume). On one machine
the tensors travel through Ray's shared-memory object store.
"""

from __future__ import annotations

import ray

from molt_train.rollout import GroupStream, RolloutWorker
from molt_train.trainer import TrainerGroup


class Runtime:
    @classmethod
    async def start(cls, config, model_dir: str, resume_from, state: dict) -> Runtime:
        self = cls()
        self.config = config
        if not ray.is_initialized():
            ray.init(address=config.ray.address, num_cpus=config.ray.num_cpus, include_dashboard=False,
                     log_to_driver=True, configure_logging=False)
        start_dir = str(resume_from / "policy") if resume_from else model_dir
        rollout = config.rollout
        sampling = dict(temperature=rollout.temperature, top_p=rollout.top_p, max_tokens=rollout.max_tokens,
                        seed=config.seed)
        engine = dict(name=config.engine.name, dtype=config.engine.dtype, max_model_len=config.engine.max_model_len)
        worker = ray.remote(num_cpus=0)(RolloutWorker)
        self.workers = [worker.remote(start_dir, config.env, engine, sampling, rollout.max_total_tokens,
                                      config.seed + i, state["version"], config.agent, rollout.episode_timeout)
                        for i in range(config.engine.workers)]
        self.trainer = TrainerGroup(start_dir, config)
        if resume_from:
            await self.trainer.load_optimizer(str(resume_from))
        data = state["data"]
        self.groups = GroupStream(self.workers, rollout.group_size, rollout.groups_per_step,
                                  config.train.async_queue_size, config.seed, data["next_index"], data["redo"])
        return self

    async def sync_weights(self) -> int:
        weights = ray.put(await self.trainer.weights())
        versions = [await worker.update_weights.remote(weights, self.config.rollout.partial_rollout)
                    for worker in self.workers]
        return versions[0]

    async def close(self) -> None:
        await self.trainer.close()
        for worker in self.workers:
            ray.kill(worker)
