"""Tiny offline models: a byte-level BPE tokenizer and Qwen3 / Qwen3-MoE checkpoints.

`tiny_model("dense")` returns the directory of the cached default model, built
on first use; `model_dir("tiny:chat")` resolves a `--model` flag (a tiny name
or a model directory); `molt-tiny --kind dense|moe --out DIR` builds one
explicitly.
"""

from molt_agents.tiny.build import build_tiny, model_dir, tiny_model

__all__ = ["build_tiny", "model_dir", "tiny_model"]
