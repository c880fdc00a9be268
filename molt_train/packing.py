"""Sequence packing: training items (one per trajectory segment) into micro-batches of rows.

A micro-batch is a grid of rows as wide as its longest sequence, flattened
row after row: each row holds whole sequences (first fit, longest first),
its tokens concatenated with `position_ids` restarting at 0 for each, and
the rest of the row is padding, a block of its own that trains nothing.
transformers turns restarting positions into a block-diagonal causal mask,
so no sequence attends to another, and attention costs the rows times the
width squared instead of the square of all the tokens. Micro-batches are
filled up to a token budget (padding included), and dealt to the trainer
ranks in equal numbers (FSDP ranks must run the same number of
forward/backward passes). `rows=False` packs each micro-batch as one row,
without padding, in the items' order (for forwards that take one row:
context-parallel splits, image inputs, NeMo AutoModel's own models).
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
    width: int = 0  # tokens per row (N is a whole number of rows); 0: one row

    @property
    def rows(self) -> int:
        return self.num_tokens // self.width if self.width else 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def pack(items: list[TrainItem], token_budget: int, rows: bool = True) -> list[MicroBatch]:
    """Pack `items` into micro-batches of at most `token_budget` tokens, padding included.

    With `rows`, longest first: a micro-batch's rows are as wide as its first (longest) item and take each
    later item into the first row with room; a sequence longer than the budget gets a micro-batch of its
    own. Without, one row each, greedy in the given order.
    """
    if not rows:
        return [_micro_batch([[item] for item in group], None) for group in _greedy(items, token_budget)]
    batches: list[list[list[TrainItem]]] = []  # micro-batch -> row -> items
    widths: list[int] = []
    free: list[int] = []  # tokens left in each row of the last micro-batch
    for item in sorted(items, key=lambda item: -len(item.token_ids)):
        n = len(item.token_ids)
        row = next((r for r, left in enumerate(free) if left >= n), None)
        if row is None:
            if not batches or (len(free) + 1) * widths[-1] > token_budget:
                batches.append([])
                widths.append(n)
                free = []
            batches[-1].append([])
            free.append(widths[-1])
            row = len(free) - 1
        batches[-1][row].append(item)
        free[row] -= n
    return [_micro_batch(batch, width) for batch, width in zip(batches, widths)]


def _greedy(items: list[TrainItem], token_budget: int) -> list[list[TrainItem]]:
    """The items in order, cut into groups of at most `token_budget` tokens (a longer item alone)."""
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
    return groups


def _micro_batch(rows: list[list[TrainItem]], width: int | None) -> MicroBatch:
    """The items row by row; with a `width`, each row padded to it by a sequence of its own that trains nothing."""
    ids, positions, sequence, mask, advantages, logprobs, ages, with_pads = [], [], [], [], [], [], [], []
    for row in rows:
        used = sum(len(item.token_ids) for item in row)
        pad = [] if width is None or used == width else [_padding(width - used)]
        with_pads += row + pad
    for index, item in enumerate(with_pads):
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
                      torch.tensor(logprobs, dtype=torch.float32), torch.tensor(ages), _routes(with_pads),
                      _images(with_pads), width=0 if width is None or len(rows) == 1 else width)


def _padding(n: int) -> TrainItem:
    return TrainItem(token_ids=[0] * n, mask=[0] * n, logprobs=[None] * n, ages=[0] * n, advantage=0.0)


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
    return _micro_batch([[_padding(1)]], None)


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
