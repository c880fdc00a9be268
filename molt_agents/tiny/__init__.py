"""Tiny offline models: a byte-level BPE tokenizer and Qwen3 / Qwen3-MoE checkpoints.

`tiny_model("dense")` returns the directory of the cached default model, built
on first use; `molt-tiny --kind dense|moe --out DIR` builds one explicitly.
"""

from molt_agents.tiny.build import build_tiny, tiny_model

__all__ = ["build_tiny", "tiny_model"]
