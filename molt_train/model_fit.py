"""The flags checked against the model's own `config.json`, before any actor starts.

A mismatch between a flag and the model would otherwise surface minutes
later as a wall of Ray and vLLM traceback from inside a worker; here it is
one line naming the flag. What follows the model (the engine's context
length) is resolved here too.
"""

from __future__ import annotations

import json
from pathlib import Path

from molt_train.config import Config, ConfigError


def model_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--model: {path} does not exist: is {model_dir} a Hugging Face model directory?")
    return json.loads(path.read_text())


def _text_field(model: dict, name: str):
    """A language-model field, also where a vision-language model keeps it (`text_config`)."""
    return model[name] if name in model else (model.get("text_config") or {}).get(name)


def context_limit(model: dict) -> int | None:
    """The longest sequence the model's positions cover, if its config says."""
    return _text_field(model, "max_position_embeddings")


def fit_to_model(config: Config, model_dir: str | Path) -> None:
    """Resolve `engine.max_model_len` from the model; raise a ConfigError naming the flag on a mismatch."""
    model = model_config(model_dir)
    engine, limit = config.engine, context_limit(model)
    if engine.max_model_len is None:
        engine.max_model_len = limit or 4096
    elif limit is not None and engine.max_model_len > limit:
        raise ConfigError(f"--engine.max_model_len: {engine.max_model_len} is more than the model's context "
                          f"({limit} tokens, max_position_embeddings in {model_dir}/config.json); "
                          f"set it to {limit} or less, or leave it unset to follow the model")
    if config.rollout.max_total_tokens > engine.max_model_len:
        raise ConfigError(f"--rollout.max_total_tokens: {config.rollout.max_total_tokens} does not fit the "
                          f"engine's context (--engine.max_model_len {engine.max_model_len})")
    if engine.name == "vllm" and _text_field(model, "tie_word_embeddings"):
        raise ConfigError(f"--engine.name vllm: the model in {model_dir} ties its output layer to its input "
                          "embeddings (tie_word_embeddings), and vLLM's in-place weight reload leaves the tied "
                          "lm_head stale, so the engine would keep sampling from the first weights; use "
                          "--engine.name hf, or untie the model")
    if model.get("quantization_config"):
        method = model["quantization_config"].get("quant_method", "quantized")
        raise ConfigError(f"--model: the model in {model_dir} is quantized ({method}); the trainer trains and "
                          "syncs full-precision weights: use the unquantized checkpoint")
    stored = _text_field(model, "torch_dtype") or _text_field(model, "dtype")
    if engine.dtype == "float16" and stored == "bfloat16":
        raise ConfigError("--engine.dtype float16: the model's weights are bfloat16, whose range float16 cannot "
                          "hold (activations overflow to inf); use --engine.dtype bfloat16 or float32")
    if engine.name == "vllm" and "vision_config" in model:  # vision modules may need torchvision
        from molt_agents.engines.vllm_engine import unloadable

        problem = unloadable(model_dir)
        if problem:
            raise ConfigError(f"--model {config.model}: {problem}; pass --engine.name hf")
