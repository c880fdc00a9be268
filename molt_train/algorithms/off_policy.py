"""Off-policy control: staleness bounds and importance-sampling correction.

The engine sampled each token with some weight version and reported its
logprob; the trainer recomputes the logprob with its own weights. They differ
because the weights moved (asynchronous training, partial rollout) and
because engine and trainer kernels differ. Two controls and a measurement,
pure functions:

- `stale_tokens`: which trainable tokens are older than `max_staleness`
  versions (the batch then drops their rollouts, or masks the tokens).
- `importance_weights`: ratio = exp(trainer - engine) at the token, sequence
  (sum) or geometric-mean level, turned into a weight per token by `mask`
  (drop what falls outside [low, high]), `clip` (clamp into [low, high]) or
  `truncate` (cap at high, TIS: Yao et al. 2025).
- `mismatch`: how far apart the two logprobs are. Over tokens sampled by
  the weights the trainer holds it measures the engine against the trainer
  (it should be ~0: a gap means a broken engine or weight sync); over older
  tokens it measures staleness.
"""

from __future__ import annotations

import torch


def stale_tokens(versions: torch.Tensor, mask: torch.Tensor, current_version: int, max_staleness: int) -> torch.Tensor:
    """True on trainable tokens sampled more than `max_staleness` versions ago."""
    return mask.bool() & (current_version - versions > max_staleness)


def importance_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                       sequence: torch.Tensor, level: str = "token", mode: str = "truncate",
                       low: float = 0.0, high: float = 2.0):
    """Per-token weights [T] and a keep mask [T] for the policy loss.

    `sequence` [T] is each token's sequence index (for the `seq` and `geo` levels).
    """
    log_ratio = (trainer_logprobs - engine_logprobs) * mask
    if level == "token":
        ratio = torch.exp(log_ratio)
    elif level in ("seq", "geo"):
        sums = torch.zeros(int(sequence.max()) + 1, dtype=log_ratio.dtype).index_add_(0, sequence, log_ratio)
        if level == "geo":
            counts = torch.zeros_like(sums).index_add_(0, sequence, mask.to(sums.dtype))
            sums = sums / counts.clamp(min=1)
        ratio = torch.exp(sums)[sequence]
    else:
        raise ValueError(f"unknown importance-sampling level {level!r}; choose token, seq or geo")
    if mode == "mask":
        keep = (ratio >= low) & (ratio <= high)
        weights = torch.where(keep, ratio, torch.zeros_like(ratio))
    elif mode == "clip":
        keep = torch.ones_like(ratio, dtype=torch.bool)
        weights = ratio.clamp(low, high)
    elif mode == "truncate":
        keep = torch.ones_like(ratio, dtype=torch.bool)
        weights = ratio.clamp(max=high)
    else:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; choose mask, clip or truncate")
    return weights.detach(), keep & mask.bool()


def mismatch(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
             mask: torch.Tensor) -> tuple[float, float | None]:
    """Trainer-vs-engine logprob mismatch over the tokens in `mask`: the k3 estimate of KL(engine || trainer)
    summed over them (sums add up across micro-batches and ranks; divide by the token count), and the
    largest |trainer - engine| (None when `mask` selects no token)."""
    m = mask.bool()
    if not m.any():
        return 0.0, None
    delta = (trainer_logprobs - engine_logprobs)[m]
    return float((torch.exp(delta) - 1 - delta).sum()), float(delta.abs().max())
