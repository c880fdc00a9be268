"""Policy losses, KL estimators and the entropy bonus, as pure functions over token tensors.

Tensors are flat over the tokens of a micro-batch ([T]); `mask` is 1 on the
tokens trained. Losses return the *sum* over masked tokens: the caller divides
by the number of trainable tokens in the whole optimizer step (token-level
aggregation over the step), so micro-batching does not change the gradient.
"""

from __future__ import annotations

import torch


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                  dual_clip: float | None = None, weights: torch.Tensor | None = None):
    """PPO's clipped surrogate (Schulman et al. 2017), asymmetric clip (DAPO's clip-higher).

    ratio = exp(logprobs - old_logprobs), clipped to [1 - clip_low, 1 + clip_high].
    Dual clip (Ye et al. 2020): for negative advantages the loss is bounded by
    `-dual_clip * A`. `weights` are importance weights (detached) on each token.
    Returns (loss summed over masked tokens, fraction of masked tokens clipped).
    """
    return _clipped_surrogate(torch.exp(logprobs - old_logprobs), advantages, mask, clip_low, clip_high, dual_clip,
                              weights)


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, sequence: torch.Tensor, clip_low: float = 3e-4, clip_high: float = 4e-4,
              weights: torch.Tensor | None = None):
    """GSPO (Zheng et al. 2025): the ratio is the sequence's geometric-mean ratio, clipped per sequence.

    `sequence` [T] gives each token's sequence index. Each token carries its
    sequence's ratio (with the token's own gradient path, as in the paper's
    GSPO-token form); the loss is summed over masked tokens like the others.
    """
    count = torch.zeros(int(sequence.max()) + 1, dtype=logprobs.dtype).index_add_(0, sequence, mask)
    delta = ((logprobs - old_logprobs) * mask)
    mean_delta = torch.zeros_like(count).index_add_(0, sequence, delta) / count.clamp(min=1)
    seq_ratio = torch.exp(mean_delta[sequence].detach() + logprobs - logprobs.detach())
    return _clipped_surrogate(seq_ratio, advantages, mask, clip_low, clip_high, None, weights)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float,
                       clip_high: float, dual_clip: float | None, weights: torch.Tensor | None):
    """The clipped surrogate both losses share, from their ratio: (sum over masked tokens, fraction clipped)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    if weights is not None:
        loss = loss * weights
    was_clipped = ((clipped > unclipped) & mask.bool()).float().sum() / mask.sum().clamp(min=1)
    return (loss * mask).sum(), was_clipped


K3_MAX = 10.0


def kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman 2020).

    k1 = log r, k2 = (log r)^2 / 2, k3 = (r' - 1) - log r', with log r = logp - logp_ref, r' = 1/r.
    k3 grows as exp(logp_ref - logp) where the policy gives a sampled token far less probability than the
    reference, and so does its gradient: one such token (a grad norm of 1e5 was seen) outweighs the rest
    of the step, and after gradient clipping sets its direction. It is capped at `K3_MAX` (as verl caps
    its low-variance KL), where such a token adds no gradient.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return (torch.exp(-log_ratio.clamp(min=-20.0)) - 1 + log_ratio).clamp(max=K3_MAX)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each row's categorical distribution."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


def nll(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning's loss: the negative log-likelihood of the masked tokens, summed."""
    return -(logprobs * mask).sum()
