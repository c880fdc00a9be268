"""NeMo AutoModel as the large-scale actor backend: its own MoE models and its parallelizers.

For a mixture-of-experts checkpoint whose architecture AutoModel implements
itself (Qwen3-MoE, DeepSeek-V3, GLM-4-MoE, ...), the actor is AutoModel's own
class: grouped experts, a `Gate` per layer that asks a router-replay handle
for its experts (routing replay drives it), expert parallelism. Its weights
are loaded from, and leave for the engines and checkpoints as, Hugging Face
tensors through the model's state-dict adapter. Every other model is the
transformers class sharded by AutoModel's FSDP2 parallelizer.

Both run on CPU over gloo, so the same code path is tested here: the native
classes with AutoModel's plain-torch kernels (SDPA attention, per-expert
loop, DTensor dispatch), the ones that run everywhere. On CUDA machines
`nemo-automodel` cannot share an environment with vLLM (conflicting
`quack-kernels` pins): there it runs in the trainer's own environment.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch import nn


def native_class(model_dir: str | Path):
    """AutoModel's own class for this checkpoint, if it is a text MoE model AutoModel implements; else None."""
    from nemo_automodel._transformers.registry import ModelRegistry
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    moe = any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    if not moe or hasattr(config, "vision_config") or not getattr(config, "architectures", None):
        return None
    return ModelRegistry.resolve_custom_model_cls(config.architectures[0], config)


def is_native(model: nn.Module) -> bool:
    """Whether `model` is one of AutoModel's own classes (it converts its weights to HF names)."""
    return getattr(model, "state_dict_adapter", None) is not None


@contextmanager
def _without_cuda():
    """AutoModel's constructors name `cuda:<current device>` for their rotary tables; on a machine
    without CUDA, let them name cuda:0 (the tables are moved to the CPU right after)."""
    if torch.cuda.is_available():
        yield
        return
    with mock.patch("torch.cuda.current_device", return_value=0):
        yield


def load_native(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """AutoModel's own MoE model with the checkpoint's weights, in `dtype`, on the CPU (sharding moves it).

    Its auxiliary load-balancing loss is off: the actor trains on the RL loss alone, as the
    transformers path does."""
    from nemo_automodel.components.models.common import BackendConfig
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cls = native_class(model_dir)
    if cls is None:
        raise ValueError(f"NeMo AutoModel has no MoE class of its own for the model in {model_dir}")
    config = AutoConfig.from_pretrained(str(model_dir))
    config.torch_dtype = dtype
    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", rope_fusion=False, experts="torch",
                            dispatcher="torch", enable_hf_state_dict_adapter=True)
    with _without_cuda():
        model = cls(config, backend=backend, moe_overrides={"aux_loss_coeff": 0.0})
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for module in model.modules():
        if type(module).__name__ == "RotaryEmbedding" and isinstance(getattr(module, "device", None), torch.device):
            module.device = device
    hf_weights = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        hf_weights.update(load_file(file))
    model.load_state_dict(model.state_dict_adapter.from_hf(hf_weights))
    return model.to(dtype)


def hf_tensors(model: nn.Module, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One of the model's (full) tensors as the Hugging Face tensors it stands for (itself, for HF models;
    e.g. one per expert for AutoModel's grouped experts)."""
    if not is_native(model):
        return [(name, tensor)]
    return list(model.state_dict_adapter.convert_single_tensor_to_hf(name, tensor))


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, N, N] boolean attention mask of packed sequences (`position_ids` [N] restart at 0 for each):
    each token sees the tokens before it in its own sequence."""
    sequence = torch.cumsum(position_ids == 0, 0)
    index = torch.arange(len(position_ids), device=position_ids.device)
    mask = (sequence[:, None] == sequence[None, :]) & (index[:, None] >= index[None, :])
    return mask[None, None]


def native_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Logits [1, N, vocab] of one packed row through an AutoModel model."""
    out = model(input_ids[None], position_ids=position_ids[None], attention_mask=packed_causal_mask(position_ids),
                padding_mask=torch.zeros_like(input_ids, dtype=torch.bool)[None])
    return getattr(out, "logits", out)


def shard_model(model: nn.Module, data_parallel: int, tensor_parallel: int = 1,
                param_dtype: torch.dtype | None = None, activation_checkpointing: bool = False,
                offload: bool = False) -> nn.Module:
    """Shard `model` over this process group with AutoModel's parallelizer: its MoE one for its own
    models, `fsdp2_strategy_parallelize` for transformers models.

    Parameters are computed in `param_dtype` (default: the model's own dtype;
    AutoModel's default would be bfloat16) and gradients reduced in fp32;
    `activation_checkpointing` recomputes each block in backward, `offload`
    keeps the shards on the host (FSDP2's `CPUOffloadPolicy`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (1, data_parallel, tensor_parallel),
                            mesh_dim_names=("dp_replicate", "dp_shard_cp", "tp"))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype or next(model.parameters()).dtype,
                                  reduce_dtype=torch.float32, output_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else None
    if is_native(model):
        from nemo_automodel.components.moe.parallelizer import parallelize_model

        model.to(device)
        parallelize_model(model, mesh, None, dp_axis_names=("dp_shard_cp",), tp_axis_name="tp",
                          mp_policy=policy, offload_policy=offload_policy, reshard_after_forward=True,
                          activation_checkpointing=activation_checkpointing)
        return model
    from nemo_automodel.components.distributed.parallelizer import fsdp2_strategy_parallelize

    return fsdp2_strategy_parallelize(model, mesh, mp_policy=policy, offload_policy=offload_policy,
                                      activation_checkpointing=activation_checkpointing)
