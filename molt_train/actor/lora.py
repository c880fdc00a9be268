"""LoRA through PEFT: the policy as the frozen model plus low-rank adapters.

`with_adapters` wraps the transformers model in PEFT's `PeftModel` before it
is sharded; every weight of the model is then frozen and only the adapters'
A and B matrices train (B starts at zero, so the policy starts as the model).
The adapters are drawn from the run's seed alone, so every rank and every
world size starts from the same ones.

Names: the trainer holds an adapter as PEFT's module does
(`...q_proj.lora_A.default.weight`); PEFT's files, and so vLLM, name it
without the adapter's name (`...q_proj.lora_A.weight`, `file_key`). The
weight sync sends the file names, and the engines write what they receive
as a PEFT adapter directory for vLLM to load, with `adapter_config`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from molt_train.config import LoraConfig

ADAPTER_NAME = "default"  # PEFT's name for a model's one adapter
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(lora: LoraConfig):
    """PEFT's `LoraConfig` for the run's `--actor.lora.*`."""
    from peft import LoraConfig as PeftLoraConfig

    targets = "all-linear" if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM")


def adapter_config(lora: LoraConfig) -> dict:
    """The adapter_config.json of the run's adapters, as PEFT writes it (what an engine needs to serve them)."""
    config = peft_config(lora).to_dict()
    return json.loads(json.dumps(config, default=sorted))  # PEFT keeps some fields as sets


def with_adapters(model: torch.nn.Module, lora: LoraConfig, seed: int):
    """`model` (frozen from here on) with new adapters drawn from `seed` alone."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config(lora))


def load_adapters(model, directory: str | Path) -> None:
    """Give the wrapped, unsharded `model` the adapters saved in `directory` (PEFT's format)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(directory) / WEIGHTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no LoRA adapter at {path}")
    result = set_peft_model_state_dict(model, load_file(str(path)))
    missing = [key for key in result.missing_keys if "lora_" in key]
    if missing:
        raise ValueError(f"the adapter in {directory} lacks {len(missing)} of the run's adapters "
                         f"(first: {missing[0]}); were --actor.lora.* the same?")


def file_key(name: str) -> str:
    """An adapter tensor's name in PEFT's files (and vLLM's) from its name in the PEFT model."""
    return name.replace(f".{ADAPTER_NAME}.", ".")
