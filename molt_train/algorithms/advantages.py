"""Advantage estimators: one reward per rollout in, one advantage per rollout out.

All take `rewards` [R] (one per rollout: a multi-segment rollout counts once)
and `groups` [R] (integer group index: rollouts of the same prompt) and
return advantages [R]; the loop broadcasts each to the rollout's trainable
tokens. Selected by name with `ESTIMATORS[name]`.

- `reinforce_pp`: REINFORCE++ (Hu 2025, arXiv:2501.03262): the reward,
  whitened over the batch (weighted by tokens). No critic, no group.
- `reinforce_pp_baseline`: REINFORCE++ with the group mean as baseline, then
  divided by the batch standard deviation.
- `grpo`: GRPO (Shao et al. 2024, arXiv:2402.03300): (r - group mean) / group std.
- `dr_grpo`: Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): r - group mean, no std.
- `rloo`: RLOO (Ahmadian et al. 2024, arXiv:2402.14740): r - mean of the others.
- `gspo`: GSPO (Zheng et al. 2025, arXiv:2507.18071) uses GRPO's advantage;
  its difference is the sequence-level ratio in the loss.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def _group_stats(rewards: torch.Tensor, groups: torch.Tensor):
    """Per-rollout mean, std and size of its group."""
    _, index, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, index, rewards)
    means = sums / counts
    squares = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, index, (rewards - means[index]) ** 2)
    stds = torch.sqrt(squares / counts)  # population std, as GRPO uses
    return means[index], stds[index], counts[index].to(rewards.dtype)


def _whiten(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    weights = torch.ones_like(values) if weights is None else weights.to(values.dtype)
    mean = (values * weights).sum() / weights.sum()
    std = torch.sqrt(((values - mean) ** 2 * weights).sum() / weights.sum())
    return (values - mean) / (std + EPS)


def reinforce_pp(rewards, groups, lengths=None):
    return _whiten(rewards, lengths)


def reinforce_pp_baseline(rewards, groups, lengths=None):
    mean, _, _ = _group_stats(rewards, groups)
    centered = rewards - mean
    weights = torch.ones_like(centered) if lengths is None else lengths.to(centered.dtype)
    std = torch.sqrt((centered ** 2 * weights).sum() / weights.sum())  # around 0: the baseline is the mean
    return centered / (std + EPS)


def grpo(rewards, groups, lengths=None):
    mean, std, _ = _group_stats(rewards, groups)
    return (rewards - mean) / (std + EPS)


def dr_grpo(rewards, groups, lengths=None):
    mean, _, _ = _group_stats(rewards, groups)
    return rewards - mean


def rloo(rewards, groups, lengths=None):
    mean, _, count = _group_stats(rewards, groups)
    others = (mean * count - rewards) / (count - 1).clamp(min=1)
    return torch.where(count > 1, rewards - others, torch.zeros_like(rewards))


ESTIMATORS = {
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "gspo": grpo,
}


def zero_variance_groups(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """True for rollouts whose group's rewards are all equal (no learning signal; dynamic filtering)."""
    _, std, count = _group_stats(rewards, groups)
    return (std < EPS) & (count > 1)


def kl_penalized_advantages(advantages: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                            sequence: torch.Tensor, beta: float) -> torch.Tensor:
    """KL as a reward (REINFORCE++ style): each token's advantage minus beta times the KL still to come.

    Tensors are flat over tokens ([T]); `sequence` gives each token's sequence
    index. A_t' = A_t - beta * sum of kl_s over the sequence's trained tokens s >= t.
    """
    x = kl * mask
    inclusive = torch.cumsum(x, 0)
    exclusive = inclusive - x
    count = int(sequence.max()) + 1
    total = torch.zeros(count, dtype=x.dtype).index_add_(0, sequence, x)
    first = torch.full((count,), len(x), dtype=torch.long).scatter_reduce_(
        0, sequence, torch.arange(len(x)), reduce="amin")
    before = exclusive - exclusive[first][sequence]  # this sequence's KL before t
    return advantages - beta * (total[sequence] - before)
