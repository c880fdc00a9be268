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
loop, DTensor dispatch), the ones that run everywhere; so do tensor
parallel (transformers' plans) and expert parallel (AutoModel's own MoE
classes) on AutoModel's device mesh, and context parallel for the
transformers classes: each packed row is split into contiguous pieces, one
per context-parallel rank (`split_sequence`), attention runs AutoModel's
block-diagonal kernel (keys and values all-gathered, a per-sequence causal
mask rebuilt from the sequence ids), and the per-token values are gathered
back whole (`gather_sequence`). On CUDA machines
`nemo-automodel` cannot share an environment with vLLM (conflicting
`quack-kernels` pins): there it runs in the trainer's own environment.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager
from unittest import mock

import torch
from torch import nn


def native_class(model_dir: str | Path):
    """AutoModel's own class for this checkpoint, if it is a text MoE model AutoModel implements; else None."""
    from nemo_automodel._transformers.registry import ModelRegistry
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    if not is_moe(config) or hasattr(config, "vision_config") or not getattr(config, "architectures", None):
        return None
    return ModelRegistry.resolve_custom_model_cls(config.architectures[0], config)


def is_moe(config) -> bool:
    """Whether a model's config declares experts."""
    return any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


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
    """AutoModel's own MoE model with the checkpoint's weights, in `dtype`, on the CPU (sharding moves it)."""
    model = build_native(model_dir, dtype)
    model.load_state_dict(native_state(model, model_dir, dtype))
    return model.to(dtype)


def build_native(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """AutoModel's own MoE model for the checkpoint in `model_dir`, in `dtype`, its weights as its constructor
    makes them (on the meta device within `fsdp.parameters_on_meta`).

    Its auxiliary load-balancing loss is off: the actor trains on the RL loss alone, as the
    transformers path does."""
    from nemo_automodel.components.models.common import BackendConfig
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
    return model


def native_state(model: nn.Module, model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights of the checkpoint in `model_dir` as `model`'s full state dict (AutoModel's layout: the experts
    of a layer grouped, in `dtype`; the other tensors as the checkpoint stores them), through the model's
    state-dict adapter."""
    from safetensors.torch import load_file

    hf_weights = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        hf_weights.update(load_file(file))
    adapter = model.state_dict_adapter
    model_dtype, adapter.dtype = adapter.dtype, dtype  # the adapter groups the experts in its own dtype
    try:
        return adapter.from_hf(hf_weights)  # (it empties `hf_weights` as it converts)
    finally:
        adapter.dtype = model_dtype


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


def device_mesh(tensor_parallel: int = 1, context_parallel: int = 1, expert_parallel: int = 1):
    """AutoModel's `MeshContext` over this process group: the device mesh (pp, dp_replicate, dp_shard, cp,
    tp; the data-parallel size is what the world size leaves) and, with `expert_parallel`, the expert mesh
    (ep_shard, ep) folded into the same ranks."""
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes

    return MeshContext.build(FSDP2Config(), ParallelismSizes(tp_size=tensor_parallel, cp_size=context_parallel,
                                                             ep_size=expert_parallel))


def shard_model(model: nn.Module, mesh=None, param_dtype: torch.dtype | None = None,
                activation_checkpointing: bool = False, offload: bool = False) -> nn.Module:
    """Shard `model` over `mesh` (a `device_mesh`; default: data parallel over every rank) with AutoModel's
    parallelizers: its MoE one for its own models (which spreads the experts over the expert mesh),
    `fsdp2_strategy_parallelize` (tensor parallel, then FSDP2) for transformers models.

    Parameters are computed in `param_dtype` (default: the model's own dtype;
    AutoModel's default would be bfloat16) and gradients reduced in fp32;
    `activation_checkpointing` recomputes each block in backward, `offload`
    keeps the shards on the host (FSDP2's `CPUOffloadPolicy`).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    mesh = mesh or device_mesh()
    check_parallel(model, mesh.cp_size, mesh.ep_size)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype or next(model.parameters()).dtype,
                                  reduce_dtype=torch.float32, output_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else None
    if mesh.cp_size > 1:
        use_context_parallel_attention(model)
    if is_native(model):
        from nemo_automodel.components.moe.parallelizer import parallelize_model

        if not next(model.parameters()).is_meta:  # (a model on the meta device is filled after sharding)
            model.to("cuda" if torch.cuda.is_available() else "cpu")
        parallelize_model(model, mesh.device_mesh, mesh.moe_mesh, mp_policy=policy, offload_policy=offload_policy,
                          reshard_after_forward=True, activation_checkpointing=activation_checkpointing,
                          **mesh.parallelize_axis_kwargs())
        return model
    from nemo_automodel.components.distributed.parallelizer import fsdp2_strategy_parallelize

    return fsdp2_strategy_parallelize(model, mesh.device_mesh, mp_policy=policy, offload_policy=offload_policy,
                                      activation_checkpointing=activation_checkpointing)


def clip_gradients(model: nn.Module, mesh, max_norm: float) -> torch.Tensor:
    """The optimizer boundary as AutoModel's own training loop takes it: gradients of weights replicated
    over tensor-parallel ranks reduced once, expert gradients (summed over the ranks that sent tokens,
    where FSDP averages the rest) divided back, then the global norm over every mesh clipped to `max_norm`.
    Returns the norm."""
    from nemo_automodel.components.distributed.mesh_utils import get_flat_mesh
    from nemo_automodel.components.distributed.tp_replicas import synchronize_tp_replica_gradients
    from nemo_automodel.components.training.utils import (
        get_expert_tp_replication_factor,
        scale_grads_and_clip_grad_norm,
    )

    synchronize_tp_replica_gradients([model], mesh.device_mesh)
    return scale_grads_and_clip_grad_norm(
        max_norm, [model], device_mesh=mesh.device_mesh, moe_mesh=mesh.moe_mesh,
        ep_axis_name="ep" if mesh.moe_mesh is not None else None,
        dp_group_size=get_flat_mesh(mesh.device_mesh, "dp_cp").size(),
        expert_tp_replication_factor=get_expert_tp_replication_factor([model], mesh.device_mesh))


def check_parallel(model: nn.Module, context_parallel: int, expert_parallel: int) -> None:
    """Refuse, naming the flag, the parallelisms this actor cannot run with AutoModel here."""
    if context_parallel > 1 and is_moe(model.config):
        raise ValueError(f"--actor.context_parallel: splits the sequences of transformers' dense models only "
                         f"({type(model).__name__} is a mixture of experts, whose routing replay takes whole "
                         f"micro-batches); use 1")
    if expert_parallel > 1 and not is_native(model):
        raise ValueError(f"--actor.expert_parallel: NeMo AutoModel has no MoE class of its own for "
                         f"{type(model).__name__}, and only its own classes spread their experts; use 1")


# ---------------------------------------------------------------------------- context parallel

CONTEXT_PARALLEL_ATTENTION = "molt_blockdiag_cp"


def _context_parallel_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A transformers attention function: this rank's queries [1, heads, L, head_dim] against the keys and
    values of the whole row (AutoModel's `cp_blockdiag_sdpa` all-gathers them; backward reduce-scatters
    their gradients), each token seeing the tokens before it in its own sequence. The model's own mask is
    not used: the mask comes from the sequence ids that `split_sequence` handed to its context."""
    from nemo_automodel.components.distributed.blockdiag_cp import cp_blockdiag_sdpa, current_blockdiag_cp_state

    if current_blockdiag_cp_state() is None:  # outside it, cp_blockdiag_sdpa would attend unmasked
        raise RuntimeError("context-parallel attention ran outside the context of `split_sequence`")
    out = cp_blockdiag_sdpa(query, key, value, dropout_p=dropout, scale=scaling,
                            enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def use_context_parallel_attention(model: nn.Module) -> None:
    """Route the model's attention through `_context_parallel_attention` (transformers then builds no mask)."""
    from transformers import AttentionInterface

    AttentionInterface.register(CONTEXT_PARALLEL_ATTENTION, _context_parallel_attention)
    model.set_attn_implementation(CONTEXT_PARALLEL_ATTENTION)


@dataclass(frozen=True)
class SequenceShard:
    """This rank's contiguous piece of one packed row under context parallel (the row padded to a
    multiple of twice the context-parallel size, then cut into equal pieces)."""

    input_ids: torch.Tensor  # [L]
    position_ids: torch.Tensor  # [L]
    targets: torch.Tensor  # [L]: the token after each position in the row (0 past its end)
    group: object  # the context-parallel process group
    attend: Callable[[], ContextManager]  # the model's forwards and backwards (recompute) run inside it


def split_sequence(cp_mesh, input_ids: torch.Tensor, position_ids: torch.Tensor) -> SequenceShard:
    """This rank's piece of the packed row `input_ids` [N] (`position_ids` restart at 0 for each sequence),
    through AutoModel's block-diagonal context-parallel batch (`cp_mesh`: the mesh's "cp" dimension)."""
    from nemo_automodel.components.distributed.blockdiag_cp import make_cp_blockdiag_batch_and_ctx

    batch = {"input_ids": input_ids[None], "position_ids": position_ids[None],
             "labels": torch.cat([input_ids[1:], input_ids.new_zeros(1)])[None],
             "_packed_seq_ids": torch.cumsum(position_ids == 0, 0)[None]}  # 1-based; 0 marks the padding
    attend, batch, _ = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch)
    return SequenceShard(input_ids=batch["input_ids"][0], position_ids=batch["position_ids"][0],
                         targets=batch["labels"][0].clamp_min(0),  # the padding's -100 past the end
                         group=cp_mesh.get_group(), attend=attend)


class _GatherSequence(torch.autograd.Function):
    """Every rank's piece of the row, concatenated in rank order. Every rank computes the same loss from the
    whole, so the backward keeps this rank's piece of the gradient: summed over the ranks (FSDP does), the
    pieces give the loss's gradient once."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.rank, ctx.length = torch.distributed.get_rank(group), len(local)
        pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank * ctx.length:(ctx.rank + 1) * ctx.length], None


def gather_sequence(local: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Per-position values [L, ...] of this rank's piece as those of the whole padded row [L x ranks, ...]."""
    return _GatherSequence.apply(local, shard.group)
