"""The policy objective of one micro-batch, as a pure function of its token tensors.

It puts the algorithm's terms together: the importance weights of the
trainer's logprobs before the step against the engine's (`off_policy`), the
KL to the reference model as a loss term or, with `kl_in_reward`, inside the
advantages, the PPO or GSPO clipped surrogate (`losses`), and the entropy
bonus. Like the losses it returns sums over tokens; the trainer divides by
the step's trainable tokens, runs the backward and steps the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from molt_train.algorithms.advantages import kl_penalized_advantages
from molt_train.algorithms.losses import gspo_loss, kl, ppo_clip_loss
from molt_train.algorithms.off_policy import importance_weights


@dataclass
class Objective:
    """One micro-batch's loss (summed over the kept tokens, with its gradient) and what it measured."""

    loss: torch.Tensor
    clipped_frac: float  # of the kept tokens, those whose ratio the clip cut
    kept_tokens: int  # trainable tokens the importance-sampling correction kept
    kl_sum: float | None  # KL to the reference over the trainable tokens; None without a reference
    entropy_sum: float | None  # over the trainable tokens; None without an entropy bonus


def objective(algo, logprobs: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
              engine: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, sequence: torch.Tensor,
              entropy: torch.Tensor | None = None) -> Objective:
    """The loss of `algo` (an `AlgoConfig`) over flat token tensors [T]: the `logprobs` being trained, `old`
    (the same weights before the step, detached), `ref` (the reference model's), `engine` (what the engine
    reported), the per-token `advantages`, the trainable `mask` and each token's `sequence` index."""
    weights, keep = importance_weights(old, engine, mask, sequence, algo.is_level, algo.is_mode, algo.is_low,
                                       algo.is_high)
    kept = mask * keep
    if algo.kl_in_reward and ref is not None:
        advantages = kl_penalized_advantages(advantages, kl(old, ref, algo.kl_estimator), kept, sequence,
                                             algo.kl_coef)
    if algo.estimator == "gspo":
        loss, clipped = gspo_loss(logprobs, old, advantages, kept, sequence, algo.clip_low, algo.clip_high, weights)
    else:
        loss, clipped = ppo_clip_loss(logprobs, old, advantages, kept, algo.clip_low, algo.clip_high,
                                      algo.dual_clip, weights)
    kl_sum = entropy_sum = None
    if ref is not None:
        kl_per_token = kl(logprobs, ref, algo.kl_estimator)
        if not algo.kl_in_reward:
            loss = loss + algo.kl_coef * (kl_per_token * kept).sum()
        kl_sum = float((kl_per_token.detach() * mask).sum())
    if entropy is not None:
        loss = loss - algo.entropy_coef * (entropy * kept).sum()
        entropy_sum = float((entropy.detach() * mask).sum())
    return Objective(loss, float(clipped), int(kept.sum()), kl_sum, entropy_sum)
