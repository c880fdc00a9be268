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
from molt_train.plan.shape import expert_count, text_config


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


def resolve_from_model(config: Config, model_dir: str | Path, local: bool = True) -> None:
    """Set `engine.max_model_len` from the model where unset, then check every flag against the model: a
    ConfigError naming the flag on a mismatch.

    `local`: the engines run here, so what this machine's vLLM can load is checked too (a dry run for another
    cluster passes False)."""
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
    heads, ranks = _text_field(model, "num_attention_heads"), engine.tensor_parallel_size
    if heads and heads % ranks:
        raise ConfigError(f"--engine.tensor_parallel_size: {ranks} ranks cannot split the model's {heads} "
                          "attention heads evenly; use a divisor of the head count")
    if engine.expert_parallel and not expert_count(text_config(model)):
        raise ConfigError(f"--engine.expert_parallel: the model in {model_dir} is dense (no experts in its "
                          "config.json)")
    _fit_actor_parallel(config, model, model_dir)
    if model.get("quantization_config"):
        method = model["quantization_config"].get("quant_method", "quantized")
        raise ConfigError(f"--model: the model in {model_dir} is quantized ({method}); the trainer trains and "
                          "syncs full-precision weights: use the unquantized checkpoint")
    stored = _text_field(model, "torch_dtype") or _text_field(model, "dtype")
    if engine.dtype == "float16" and stored == "bfloat16":
        raise ConfigError("--engine.dtype float16: the model's weights are bfloat16, whose range float16 cannot "
                          "hold (activations overflow to inf); use --engine.dtype bfloat16 or float32")
    if local and engine.name == "vllm" and "vision_config" in model:  # vision modules may need torchvision
        from molt_agents.engines.vllm_engine import unloadable

        problem = unloadable(model_dir)
        if problem:
            raise ConfigError(f"--model {config.model}: {problem}; pass --engine.name hf")


def _fit_actor_parallel(config: Config, model: dict, model_dir: str | Path) -> None:
    """The actor's tensor-parallel ranks split the attention heads; its expert-parallel ranks, the experts."""
    actor = config.actor
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = _text_field(model, field)
        if heads and heads % actor.tensor_parallel:
            raise ConfigError(f"--actor.tensor_parallel: {actor.tensor_parallel} ranks cannot split the model's "
                              f"{heads} heads ({field} in {model_dir}/config.json); use a divisor of it")
    if actor.expert_parallel == 1:
        return
    count = expert_count(text_config(model))
    if not count:
        raise ConfigError(f"--actor.expert_parallel: the model in {model_dir} is dense (no experts in its "
                          "config.json); use 1")
    if count % actor.expert_parallel:
        raise ConfigError(f"--actor.expert_parallel: {actor.expert_parallel} ranks cannot share the model's "
                          f"{count} experts evenly; use a divisor of it")
