"""The typed config tree of a run: defaults here, a YAML recipe, then CLI overrides.

Every field is a flag (`--engine.dtype bfloat16`); the docstring comment under a
field is its `--help` text. `molt-train --help` lists them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class EngineConfig:
    """Rollout engine."""

    name: Literal["vllm", "hf"] = "vllm"
    """Engine backend: vllm, or hf (the transformers fallback)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Engine weight dtype."""
    max_model_len: int = 4096
    """Longest sequence (prompt + completion) the engine accepts, in tokens."""


@dataclass
class RolloutConfig:
    """Sampling during rollouts."""

    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_tokens: int = 32
    """Most tokens sampled per turn."""


@dataclass
class Config:
    """A Molt run."""

    env: str = "arithmetic"
    """Environment: a short name, a Gymnasium id (molt/Name-v0), package.module:Class or path/file.py:Class."""
    model: str | None = None
    """Model directory (Hugging Face format); default: the built-in tiny model."""
    seed: int = 0
    """Random seed for sampling and initialisation."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
