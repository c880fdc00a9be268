"""Sequence packing: training items (one per trajectory segment) into micro-batches of rows.

A micro-batch is a grid of rows of one width, flattened row after row: each
row holds whole sequences (first fit, longest first), its tokens
concatenated with `position_ids` restarting at 0 for each, and the rest of
the row is padding, a block of its own that trains nothing. The width is
the longest sequence's, or wider where that pads less (sequences a little
over half the longest's length would each take a row of their own).
transformers turns restarting positions into a block-diagonal causal mask,
so no sequence attends to another, and attention costs the rows times the
width squared instead of the square of all the tokens. Micro-batches are
filled up to a token budget (padding included), and dealt to the trainer
ranks in equal numbers (FSDP ranks must run the same number of
forward/backward passes). `rows=False` packs each micro-batch as one row,
without padding, in the items' order (for forwards that take one row:
context-parallel splits, image inputs, NeMo AutoModel's own models).

With `tree_tokens`, items whose untrained heads are the same tokens (the
samples of a group: one prompt, several replies) become prefix trees of up
to that many tokens (the trainer's: an episode's most, so that no row is
wider than without trees, nor its attention mask larger):
the head once, then each item's rest, its positions continuing from the
head's. The tree's tokens attend to the head and to their own branch
(`MicroBatch.branch`), and each branch's first token is predicted from the
head's last hidden state (`MicroBatch.predecessor`): every logprob is the
one the item alone gives, and a prompt shared by a group of 8 costs its
forward and backward once instead of 8 times.
"""

from __future__ import annotations

from collections import Counter
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
    key: str = ""  # the trajectory segment it came from (`batch.segment_key`)


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
    # [N] long: the token whose hidden state predicts this one (the one before, or for a branch's first
    # token the head's last); -1 at a sequence's start
    predecessor: torch.Tensor | None = None
    # [N] long, when the micro-batch holds a prefix tree: 0 for the tokens every sequence of their block
    # (a block starts at position 0) sees, b >= 1 for branch b's; None: sequences only, attention follows
    # the positions restarting at 0
    branch: torch.Tensor | None = None
    # [N] long: the index in `pack`'s items of the item the token belongs to (a tree's head: its first item's),
    # -1 for padding; with `position_ids`, where a token's values go back to (`TrainerGroup.trained_logprobs`)
    item: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.num_tokens // self.width if self.width else 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def pack(items: list[TrainItem], token_budget: int, rows: bool = True, tree_tokens: int = 0, max_width: int = 0,
         attention: float = 0.0) -> list[MicroBatch]:
    """Pack `items` into micro-batches of at most `token_budget` tokens, padding included.

    With `rows`, longest first, each unit (an item, or with `tree_tokens` a prefix tree of at most that many
    tokens, see `trees`) into the first row with room; a micro-batch's rows are all as wide, and a unit
    longer than the budget gets a micro-batch of its own. The width is the one of a few layouts that costs
    least: rows as wide as each micro-batch's longest unit, or for every micro-batch a wider width up to
    `max_width` (the sum of two common unit lengths, say, where units a little over half the longest's
    length would each pad a row alone). A row costs its tokens plus `attention` times the square of its
    width (its attention, computed across the row; the caller's estimate of attention's compute per token
    pair against the rest of the model's per token). A micro-batch of one row is not padded.
    Without `rows`, one row each, greedy in the given order, no trees.
    """
    places = {id(item): i for i, item in enumerate(items)}
    if not rows:
        return [_micro_batch([[[item]] for item in group], None, places) for group in _greedy(items, token_budget)]
    units = sorted(trees(items, tree_tokens) if tree_tokens else [[item] for item in items],
                   key=lambda unit: -_length(unit))
    if not units:
        return []
    layouts = [_rows(units, token_budget, width) for width in (None, *_widths(units, token_budget, max_width))]
    batches, widths = min(layouts, key=lambda layout: (_cost(*layout, attention), len(layout[0])))
    return [_micro_batch(batch, width if len(batch) > 1 else None, places) for batch, width in zip(batches, widths)]


def _rows(units: list[list[TrainItem]], token_budget: int, width: int | None):
    """First fit of the `units` (longest first) into rows `width` wide (None: each micro-batch's first unit's
    length), as many rows to a micro-batch as the budget holds: (micro-batch -> row -> units, widths)."""
    batches: list[list[list[list[TrainItem]]]] = []
    widths: list[int] = []
    free: list[int] = []  # tokens left in each row of the last micro-batch
    for unit in units:
        n = _length(unit)
        row = next((r for r, left in enumerate(free) if left >= n), None)
        if row is None:
            if not batches or (len(free) + 1) * widths[-1] > token_budget:
                batches.append([])
                widths.append(max(width or n, n))
                free = []
            batches[-1].append([])
            free.append(widths[-1])
            row = len(free) - 1
        batches[-1][row].append(unit)
        free[row] -= n
    return batches, widths


def _widths(units: list[list[TrainItem]], token_budget: int, max_width: int) -> list[int]:
    """Row widths worth trying beyond the longest unit's length, up to `max_width` and the budget: sums of two
    of the longest length and the three commonest."""
    lengths = [_length(unit) for unit in units]
    common = [length for length, _ in Counter(lengths).most_common(3)]
    choices = {lengths[0], *common}
    return sorted({a + b for a in choices for b in choices
                   if lengths[0] < a + b <= min(max_width, token_budget)})


def _cost(batches: list[list[list[list[TrainItem]]]], widths: list[int], attention: float) -> float:
    """The packed compute of a layout: each padded row's width, a micro-batch of one row its tokens, plus
    `attention` times the square of each."""
    total = 0.0
    for batch, width in zip(batches, widths):
        for size in ([width] * len(batch) if len(batch) > 1 else [sum(_length(unit) for unit in batch[0])]):
            total += size + attention * size * size
    return total


def head_length(item: TrainItem) -> int:
    """Tokens before the item's first trained one (its prompt)."""
    return next((i for i, m in enumerate(item.mask) if m), len(item.mask))


def trees(items: list[TrainItem], max_tokens: int) -> list[list[TrainItem]]:
    """The items as units: a prefix tree is a list of items with the same untrained head (at least 2 tokens,
    their expert routes there the same, no images), as many as fit `max_tokens` with the head counted
    once; any other item is a unit alone. Order within a tree is the items' order."""
    units: list[list[TrainItem]] = []
    by_head: dict[tuple[int, ...], list[TrainItem]] = {}
    for item in items:
        h = head_length(item)
        if item.images or h < 2 or h == len(item.token_ids):
            units.append([item])
        else:
            by_head.setdefault(tuple(item.token_ids[:h]), []).append(item)
    for head, group in by_head.items():
        h = len(head)
        tree: list[TrainItem] = []
        for item in group:
            if tree and (_length(tree) + len(item.token_ids) - h > max_tokens or not _same_routes(tree[0], item, h)):
                units.append(tree)
                tree = []
            tree.append(item)
        units.append(tree)
    return units


def _same_routes(first: TrainItem, item: TrainItem, head: int) -> bool:
    if first.routes is None and item.routes is None:
        return True
    return first.routes is not None and item.routes is not None and np.array_equal(first.routes[:head],
                                                                                      item.routes[:head])


def _length(unit: list[TrainItem]) -> int:
    """Tokens of a unit: an item's, or a tree's head once plus every item's rest."""
    if len(unit) == 1:
        return len(unit[0].token_ids)
    h = head_length(unit[0])
    return h + sum(len(item.token_ids) - h for item in unit)


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


def _micro_batch(rows: list[list[list[TrainItem]]], width: int | None, places: dict[int, int]) -> MicroBatch:
    """The units row by row; with a `width`, each row padded to it by a sequence of its own that trains
    nothing. A tree lays out its head (the first item's, trained by none), then each item's rest. `places`:
    each item's place in the packed list, by `id`."""
    ids, positions, sequence, mask, advantages, logprobs, ages, origin = [], [], [], [], [], [], [], []
    predecessor, branch, parts, units = [], [], [], []  # parts: (item, start) in layout order, for routes
    for row in rows:
        used = sum(_length(unit) for unit in row)
        units += row + ([] if width is None or used == width else [[_padding(width - used)]])
    index = 0
    for unit in units:
        h = head_length(unit[0]) if len(unit) > 1 else 0
        head_end = len(ids) + h - 1  # the head's last token: the predecessor of each branch's first
        for b, item in enumerate(unit):
            start = h if b else 0  # a tree's later items lay out their rest only
            n = len(item.token_ids) - start
            first = len(ids)
            parts.append((item, start))
            ids += item.token_ids[start:]
            positions += range(start, start + n)
            sequence += [index] * n
            mask += item.mask[start:]
            advantages += [0.0 if i < h else float(item.advantage) for i in range(start, len(item.token_ids))]
            logprobs += [0.0 if lp is None else lp for lp in item.logprobs[start:]]
            ages += item.ages[start:]
            origin += [places.get(id(item), -1)] * n
            predecessor += [-1 if i == 0 else (head_end if b and i == start else first + i - start - 1)
                            for i in range(start, len(item.token_ids))]
            branch += [0 if i < h else b + 1 for i in range(start, len(item.token_ids))] if h else [0] * n
            index += 1
    has_tree = any(len(unit) > 1 for unit in units)
    return MicroBatch(torch.tensor(ids), torch.tensor(positions), torch.tensor(sequence),
                      torch.tensor(mask, dtype=torch.float32), torch.tensor(advantages, dtype=torch.float32),
                      torch.tensor(logprobs, dtype=torch.float32), torch.tensor(ages), _routes(parts),
                      _images([item for item, _ in parts]), width=0 if width is None or len(rows) == 1 else width,
                      predecessor=torch.tensor(predecessor), branch=torch.tensor(branch) if has_tree else None,
                      item=torch.tensor(origin))


def _padding(n: int) -> TrainItem:
    return TrainItem(token_ids=[0] * n, mask=[0] * n, logprobs=[None] * n, ages=[0] * n, advantage=0.0)


def _images(items: list[TrainItem]) -> dict[str, torch.Tensor] | None:
    """The items' image tensors end to end, in the order their placeholders appear in the packed row."""
    images = [item.images for item in items if item.images]
    if not images:
        return None
    return {name: torch.as_tensor(value) for name, value in join_images(images).items()}


def _routes(parts: list[tuple[TrainItem, int]]) -> torch.Tensor | None:
    """The expert routes of the laid-out (item, from token) parts end to end; -1 for an item that has none
    (None when none has any)."""
    shapes = [item.routes.shape[1:] for item, _ in parts if item.routes is not None]
    if not shapes:
        return None
    return torch.cat([torch.as_tensor(item.routes[start:], dtype=torch.int16) if item.routes is not None
                      else torch.full((len(item.token_ids) - start, *shapes[0]), -1, dtype=torch.int16)
                      for item, start in parts])


def empty_micro_batch() -> MicroBatch:
    """A one-token micro-batch that trains nothing, to even out the ranks' counts."""
    return _micro_batch([[[_padding(1)]]], None, {})


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
