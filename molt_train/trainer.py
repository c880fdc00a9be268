"""The policy trainer group: `world_size` FSDP2 ranks as Ray actors, driven in lockstep.

Every call goes to all ranks at once (they run collectives together); rank 0
sends the weights to the engines (bucketed broadcast) or returns them whole. The batch is packed into
micro-batches by token budget and dealt to the ranks in equal numbers.
"""

from __future__ import annotations

import socket

import ray

from molt_train.actor.policy import PolicyRank, TrainSettings
from molt_train.packing import deal, pack


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainerGroup:
    def __init__(self, model_dir: str, config):
        algo, train = config.algo, config.train
        settings = TrainSettings(
            lr=train.lr, weight_decay=train.weight_decay, grad_clip=train.grad_clip,
            warmup_steps=train.warmup_steps, total_steps=config.steps * train.updates_per_batch,
            lr_schedule=train.lr_schedule, min_lr_ratio=train.min_lr_ratio, estimator=algo.estimator, clip_low=algo.clip_low,
            clip_high=algo.clip_high, dual_clip=algo.dual_clip, kl_coef=algo.kl_coef,
            kl_estimator=algo.kl_estimator, kl_in_reward=algo.kl_in_reward, entropy_coef=algo.entropy_coef, is_level=algo.is_level,
            is_mode=algo.is_mode, is_low=algo.is_low, is_high=algo.is_high, routing_replay=train.routing_replay,
            freeze_moe_router=config.actor.freeze_moe_router)
        self.world_size = config.actor.world_size
        self.micro_batch_tokens, self.updates = train.micro_batch_tokens, train.updates_per_batch
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        gpus = 1 if _cuda() else 0
        actor = ray.remote(num_cpus=0, num_gpus=gpus)(PolicyRank)
        self.ranks = [actor.remote(model_dir, rank, self.world_size, init_method, settings, config.seed,
                                   config.actor.backend, algo.kl_coef > 0)
                      for rank in range(self.world_size)]

    async def step(self, items: list[dict]) -> dict:
        shares = deal(pack(items, self.micro_batch_tokens), self.world_size)
        step_tokens = sum(sum(item["mask"]) for item in items)
        results = await _gather([rank.step.remote(share, step_tokens, self.updates)
                                 for rank, share in zip(self.ranks, shares)])
        total = {k: sum(r[k] for r in results) for k in results[0] if k != "mismatch_max"}
        total["mismatch_max"] = max(r["mismatch_max"] for r in results)
        return total

    async def weights(self) -> dict:
        return (await _gather([rank.full_weights.remote(for_sync=True) for rank in self.ranks]))[0]

    async def open_channel(self, host: str, port: int, size: int, bucket_bytes: int) -> None:
        await _gather([rank.open_channel.remote(host, port, size, bucket_bytes) for rank in self.ranks])

    async def broadcast_weights(self) -> None:
        await _gather([rank.broadcast_weights.remote() for rank in self.ranks])

    async def save(self, directory: str) -> None:
        await _gather([rank.save.remote(directory) for rank in self.ranks])

    async def restore(self, directory: str) -> None:
        await _gather([rank.restore.remote(directory) for rank in self.ranks])

    async def close(self) -> None:
        await _gather([rank.close.remote() for rank in self.ranks])


async def _gather(refs):
    import asyncio

    return list(await asyncio.gather(*refs))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
