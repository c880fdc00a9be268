"""Hugging Face models as both sides load and feed them: the transformers engine and the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def model_class(model_dir: str | Path):
    """transformers' auto class for the checkpoint in `model_dir`: image-text-to-text when its config has a
    vision tower, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    return AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM


def load_model(model_dir: str | Path, dtype):
    """A Hugging Face causal LM, or an image-text-to-text model when the config has a vision tower."""
    return model_class(model_dir).from_pretrained(str(model_dir), dtype=dtype)


def adapter_base(adapter_dir: str | Path) -> str:
    """The model a LoRA adapter directory (PEFT's format) was trained on, as its adapter_config.json names it."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"{adapter_dir}: not a LoRA adapter directory (no adapter_config.json)")
    base = json.loads(path.read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path} names no base model (base_model_name_or_path); pass the model directory")
    return base


def as_model_input(tensor: torch.Tensor, model) -> torch.Tensor:
    """An input tensor on the model's device, floats in its dtype."""
    dtype = model.dtype if tensor.is_floating_point() else tensor.dtype
    return tensor.to(device=model.device, dtype=dtype)


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of a mixture-of-experts model, in layer order (empty for dense models)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
