"""Sequence packing: training items (one per trajectory segment) into micro-batches with no padding.

A micro-batch is one row: the items' tokens concatenated, with
`position_ids` restarting at 0 for each; transformers turns restarting
positions into a block-diagonal causal mask, so no sequence attends to
another and no compute goes to padding. Micro-batches are filled up to a
token budget, and dealt to the trainer ranks in equal numbers (FSDP ranks
must run the same number of forward/backward passes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from molt_agents.multimodal import join_images


@dataclass
class TrainItem:
    """One trajectory segment as the trainer takes it (built by `batch.assemble`)."""

    token_ids: list[int]
    mask: list[int]  # 1 where the token is trained
    logprobs: list[float | None]  # the engine's sampling logprob where mask == 1, None elsewhere
    ages: list[int]  # policy versions between the weights that sampled the token and the trainer's; 0 where mask == 0
    advantage: float  # the rollout's, for every trained token
    routes: np.ndarray | None = None  # [T, layers, top_k] int16 engine expert ids, -1 where unknown
    images: dict[str, np.ndarray] | None = None  # the forward's image arguments


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [N] long
    position_ids: torch.Tensor  # [N] long, restarting per sequence
    sequence: torch.Tensor  # [N] long, index of the sequence in this micro-batch
    mask: torch.Tensor  # [N] float, 1 where the token is trained
    advantages: torch.Tensor  # [N] float
    engine_logprobs: torch.Tensor  # [N] float, 0 where not sampled
    ages: torch.Tensor  # [N] long, 0 where the trainer holds the weights that sampled the token
    routes: torch.Tensor | None = None  # [N, layers, top_k] int16 engine expert ids, -1 where unknown
    images: dict[str, torch.Tensor] | None = None  # the forward's image arguments, sequence after sequence

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def pack(items: list[TrainItem], token_budget: int) -> list[MicroBatch]:
    """Pack `items` into micro-batches.

    Greedy in the given order; a sequence longer than the budget gets a micro-batch of its own.
    """
    groups, current, used = [], [], 0
    for item in items:
        n = len(item.token_ids)
        if current and used + n > token_budget:
            groups.append(current)
            current, used = [], 0
        current.append(item)
        used += n
    if current:
        groups.append(current)
    return [_micro_batch(group) for group in groups]


def _micro_batch(items: list[TrainItem]) -> MicroBatch:
    ids, positions, sequence, mask, advantages, logprobs, ages = [], [], [], [], [], [], []
    for index, item in enumerate(items):
        n = len(item.token_ids)
        ids += item.token_ids
        positions += range(n)
        sequence += [index] * n
        mask += item.mask
        advantages += [float(item.advantage)] * n
        logprobs += [0.0 if lp is None else lp for lp in item.logprobs]
        ages += item.ages
    return MicroBatch(torch.tensor(ids), torch.tensor(positions), torch.tensor(sequence),
                      torch.tensor(mask, dtype=torch.float32), torch.tensor(advantages, dtype=torch.float32),
                      torch.tensor(logprobs, dtype=torch.float32), torch.tensor(ages), _routes(items), _images(items))


def _images(items: list[TrainItem]) -> dict[str, torch.Tensor] | None:
    """The items' image tensors end to end, in the order their placeholders appear in the packed row."""
    images = [item.images for item in items if item.images]
    if not images:
        return None
    return {name: torch.as_tensor(value) for name, value in join_images(images).items()}


def _routes(items: list[TrainItem]) -> torch.Tensor | None:
    """The items' expert routes end to end; -1 for an item that has none (None when none has any)."""
    shapes = [item.routes.shape[1:] for item in items if item.routes is not None]
    if not shapes:
        return None
    return torch.cat([torch.as_tensor(item.routes, dtype=torch.int16) if item.routes is not None
                      else torch.full((len(item.token_ids), *shapes[0]), -1, dtype=torch.int16)
                      for item in items])


def empty_micro_batch() -> MicroBatch:
    """A one-token micro-batch that trains nothing, to even out the ranks' counts."""
    return _micro_batch([TrainItem(token_ids=[0], mask=[0], logprobs=[None], ages=[0], advantage=0.0)])


def deal(micro_batches: list[MicroBatch], world_size: int) -> list[list[MicroBatch]]:
    """Give each rank the same number of micro-batches, balancing tokens (largest first)."""
    ordered = sorted(micro_batches, key=lambda mb: -mb.num_tokens)
    while len(ordered) % world_size:
        ordered.append(empty_micro_batch())
    shares: list[list[MicroBatch]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    per_rank = len(ordered) // world_size
    for mb in ordered:
        rank = min((r for r in range(world_size) if len(shares[r]) < per_rank), key=lambda r: loads[r])
        shares[rank].append(mb)
        loads[rank] += mb.num_tokens
    return shares
