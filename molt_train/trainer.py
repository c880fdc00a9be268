"""The policy trainer group: `world_size` FSDP2 ranks as Ray actors, driven in lockstep.

Every call goes to all ranks at once (they run collectives together); rank 0
sends the weights to the engines (bucketed broadcast) or returns them whole.
The batch is packed into micro-batches by token budget (grids of rows at
least as wide as their longest sequence or prefix tree, see `packing`) and dealt to the
data-parallel replicas in equal numbers (the tensor- and context-parallel
ranks of a replica get the same ones); the replicas' step statistics are
combined as each declares.
"""

from __future__ import annotations

import time
from dataclasses import replace

import ray

from molt_train.actor.policy import PolicyRank, StepStats
from molt_train.config import Config
from molt_train.model_fit import model_config
from molt_train.packing import TrainItem, deal, pack
from molt_train.placement import Placement
from molt_train.plan.shape import text_config
from molt_train.weight_sync import free_endpoint


async def rendezvous(placement: Placement) -> tuple[str, int]:
    """A host and a free port on the node of rank 0's slot (found by a task there, unless that node is this
    process's own): for the trainer's process group, and for the weight-sync channel. The task asks nothing
    of the slot's CPUs and GPUs: once rank 0 runs, its actor holds them."""
    if placement.nodes()["trainer"][0] == ray.get_runtime_context().get_node_id():
        return free_endpoint()
    slot = replace(placement.trainer_rank(0), num_cpus=0, num_gpus=0)
    return await ray.remote(free_endpoint).options(**slot.options()).remote()


def attention_per_token(model: dict) -> float:
    """Attention's compute for one more token pair in a row, against the rest of a token's compute: about
    1 / (6 x hidden size) in a decoder whose MLP is some three times as wide as its hidden states (4 x hidden
    multiply-adds a pair, 24 x hidden^2 a token). 0 where the config does not say."""
    hidden = text_config(model).get("hidden_size")
    return 1 / (6 * hidden) if hidden else 0.0


class TrainerGroup:
    def __init__(self, model_dir: str, start_dir: str, config: Config, placement: Placement,
                 rendezvous: tuple[str, int], sft: bool = False):
        """The run's `PolicyRank`s (`model_dir`, `start_dir` and `sft` as there), each in its `placement` slot,
        meeting the others at `rendezvous` (a host and port on rank 0's node, see `rendezvous`)."""
        self.world_size = config.actor.world_size
        # Ranks in a row share one model replica (tensor / context parallel) and its micro-batches.
        self.data_parallel = config.actor.data_parallel
        self.replica_ranks = config.actor.world_size // self.data_parallel
        self.micro_batch_tokens, self.updates = config.train.micro_batch_tokens, config.train.updates_per_batch
        # Prefix trees, and rows, as long as an episode may be (what the memory plan counts on; see `packing`).
        self.max_width = min(config.train.micro_batch_tokens, config.rollout.max_total_tokens)
        self.tree_tokens = self.max_width if config.train.share_prefix else 0
        self.attention = attention_per_token(model_config(model_dir))
        # Packed grids of rows for the fsdp2 backend; one row for AutoModel (its own classes, context parallel).
        self.rows = config.actor.backend == "fsdp2"
        actor, (host, port) = ray.remote(PolicyRank), rendezvous
        self.ranks = [actor.options(**placement.trainer_rank(rank).options()).remote(
                          model_dir, start_dir, rank, self.world_size, f"tcp://{host}:{port}", config, sft)
                      for rank in range(self.world_size)]

    def _shares(self, items: list[TrainItem]) -> list:
        """`items` packed into micro-batches and dealt to the data-parallel replicas."""
        rows = self.rows and not any(item.images for item in items)
        return deal(pack(items, self.micro_batch_tokens, rows, self.tree_tokens, self.max_width, self.attention),
                    self.data_parallel)

    async def step(self, items: list[TrainItem]) -> StepStats:
        """One optimizer step (or `updates_per_batch` of them) on `items`; the statistics of the whole group."""
        started = time.perf_counter()
        shares = self._shares(items)
        step_tokens = sum(sum(item.mask) for item in items)
        packed = time.perf_counter() - started
        stats = await _gather([rank.step.remote(shares[index // self.replica_ranks], step_tokens, self.updates)
                               for index, rank in enumerate(self.ranks)])
        self.last_shares = shares
        # one rank per replica: its tokens counted once
        return replace(StepStats.reduce(stats[::self.replica_ranks]), seconds_pack=packed)

    async def trained_logprobs(self, items: list[TrainItem]) -> list[list[float | None]]:
        """The last step's `items` token by token: the trainer's logprob under the weights before the step
        where the token was trained, None elsewhere."""
        out: list[list[float | None]] = [[None] * len(item.token_ids) for item in items]
        replicas = await _gather([rank.trained_logprobs.remote() for rank in self.ranks[::self.replica_ranks]])
        for share, values in zip(self.last_shares, replicas):
            for mb, logprobs in zip(share, values):
                trained = mb.mask.bool()
                for item, position, value in zip(mb.item[trained].tolist(), mb.position_ids[trained].tolist(),
                                                 logprobs.tolist()):
                    out[item][position] = value
        return out

    async def nll(self, items: list[TrainItem]) -> float:
        """The mean negative log-likelihood of the tokens `items` train, under the current weights."""
        shares = self._shares(items)
        sums = await _gather([rank.nll.remote(shares[index // self.replica_ranks])
                              for index, rank in enumerate(self.ranks)])
        total, tokens = (sum(values) for values in zip(*sums[::self.replica_ranks]))
        return total / max(tokens, 1)

    async def weights(self) -> dict:
        return (await _gather([rank.full_weights.remote(for_sync=True) for rank in self.ranks]))[0]

    async def open_channel(self, host: str, port: int, size: int, bucket_bytes: int) -> None:
        await _gather([rank.open_channel.remote(host, port, size, bucket_bytes) for rank in self.ranks])

    async def broadcast_weights(self) -> int:
        """The weights to the workers on the channel; the bytes sent."""
        return (await _gather([rank.broadcast_weights.remote() for rank in self.ranks]))[0]

    async def save(self, directory: str) -> None:
        await _gather([rank.save.remote(directory) for rank in self.ranks])

    async def restore(self, directory: str) -> None:
        await _gather([rank.restore.remote(directory) for rank in self.ranks])

    async def close(self) -> None:
        """Close every rank whose process still runs. One that died (a signal to the whole process group, as
        `timeout` and Slurm send, ends the run's own Ray and its actors with it) has nothing left to close, and
        the run's own error or stop message stands."""
        import asyncio

        for result in await asyncio.gather(*(rank.close.remote() for rank in self.ranks), return_exceptions=True):
            if isinstance(result, Exception) and not isinstance(result, ray.exceptions.RayActorError):
                raise result


async def _gather(refs):
    """Every rank's result; a rank whose process died ends the run, saying so (resume continues it)."""
    import asyncio

    from molt_train.console import cause

    try:
        return list(await asyncio.gather(*refs))
    except ray.exceptions.RayActorError as error:
        raise RuntimeError(f"a trainer rank's process died: {cause(error)}") from error
