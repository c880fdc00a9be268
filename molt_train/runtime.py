"""The Ray runtime behind the loop: rollout workers, the trainer group, the weight sync.

Local `ray.init` by default, or `--ray.address` to join a cluster. Actors ask
for no CPUs (the engine and the trainer ranks share the machine; placement
is explicit through `engine.workers` and `actor.world_size`).

Weight sync (pause, load, version + 1, resume, between two engine steps):
by default the trainer broadcasts the weights in buckets on a channel of its
own to every worker (`weight_sync`: NCCL on GPU, gloo on CPU); or rank 0
gathers the whole model and it travels through Ray's object store.
"""

from __future__ import annotations

import asyncio

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
                                      config.seed + i, state["version"], config.agent, rollout.episode_timeout,
                                      rollout.allow_remote_images)
                        for i in range(config.engine.workers)]
        self.trainer = TrainerGroup(model_dir, start_dir, config)
        print(f"# actor: {await self.trainer.ranks[0].describe.remote()}", flush=True)
        if resume_from:
            await self.trainer.restore(str(resume_from))
        if config.train.weight_sync == "broadcast":
            await self._open_channel()
        data = state["data"]
        self.groups = GroupStream(self.workers, rollout.group_size, rollout.groups_per_step,
                                  config.train.async_queue_size, config.seed, data["next_index"], data["redo"])
        return self

    async def _open_channel(self) -> None:
        rank0 = self.trainer.ranks[0]
        host, port = await rank0.channel_endpoint.remote()
        metas = await rank0.weight_meta.remote()
        size, bucket_bytes = 1 + len(self.workers), self.config.train.sync_bucket_mb << 20
        await asyncio.gather(self.trainer.open_channel(host, port, size, bucket_bytes),
                             *(worker.open_channel.remote(host, port, 1 + i, size, metas, bucket_bytes)
                               for i, worker in enumerate(self.workers)))

    async def sync_weights(self) -> int:
        """Push the trainer's weights to every engine; returns the new policy version."""
        partial = self.config.rollout.partial_rollout
        if self.config.train.weight_sync == "broadcast":
            _, *versions = await asyncio.gather(self.trainer.broadcast_weights(),
                                                *(worker.update_weights.remote(None, partial)
                                                  for worker in self.workers))
        else:
            weights = ray.put(await self.trainer.weights())
            versions = await asyncio.gather(*(worker.update_weights.remote(weights, partial)
                                              for worker in self.workers))
        return versions[0]

    async def close(self) -> None:
        await self.trainer.close()
        for worker in self.workers:
            ray.kill(worker)
