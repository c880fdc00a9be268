"""Overlong shaping: DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

An episode's length is the tokens the policy generated in it (all its turns).
Up to `limit - buffer` tokens it costs nothing; over the last `buffer` tokens
before `limit` the penalty grows linearly, (length - (limit - buffer)) / buffer
of `scale`; at `limit` and beyond it is the whole `scale`. The penalty is added
to the episode's reward before advantages: a long reply that is right gets
less than a short one that is right, so lengths stay off the limit where
replies are cut.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, limit: int, buffer: int, scale: float = 1.0) -> torch.Tensor:
    """The penalty (<= 0) of episodes with `lengths` generated tokens; zeros when `buffer` is 0."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.to(torch.float32) - (limit - buffer)) / buffer
    return -scale * over.clamp(0.0, 1.0)
