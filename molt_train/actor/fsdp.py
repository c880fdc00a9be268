"""Shard a transformers causal LM with PyTorch FSDP2 (`fully_shard`).

One process group, gloo on CPU and NCCL on GPU. Each decoder block is its own
FSDP unit (so only one block's full parameters exist at a time), then the
root module takes what is left (embeddings, final norm, lm_head).

Memory options, all applied here: bf16 compute over fp32 master weights
(`MixedPrecisionPolicy`), activation checkpointing of every block or every
other one (their activations are recomputed in backward), and CPU offload of the
sharded parameters, gradients and optimizer states (`CPUOffloadPolicy`).

Loading once per trainer: with several ranks, every rank builds the model
with its parameters on the meta device (`parameters_on_meta`: no memory, no
values) and shards it; only rank 0 reads the checkpoint, in the dtype it is
stored in, and `fill_from_rank0` broadcasts it tensor by tensor, each rank
keeping its shards (cast to the fp32 master weights). A host never holds
more than rank 0's one copy of the checkpoint.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def init_process_group(rank: int, world_size: int, init_method: str) -> torch.device:
    """Join the trainer's process group; returns this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return device


def destroy_process_group() -> None:
    # Without the barrier gloo occasionally aborts at exit on CPU.
    dist.barrier()
    dist.destroy_process_group()


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found by the model's own `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules; cannot find its decoder blocks")
    return blocks


def checkpoint_blocks(model: nn.Module, every: int = 1) -> list[nn.Module]:
    """Wrap every `every`-th decoder block (from the first) in torch's non-reentrant activation
    checkpointing, in place; returns all the blocks in order, the wrapped ones as their wrappers.
    State-dict keys stay the blocks' own (the wrapper strips its prefix)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    blocks = decoder_blocks(model)
    chosen, wrappers = {id(block) for block in blocks[::every]}, {}
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if id(child) in chosen:
                wrappers[id(child)] = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                setattr(parent, name, wrappers[id(child)])
    return [wrappers.get(id(block), block) for block in blocks]


def shard_model(model: nn.Module, param_dtype: torch.dtype = torch.float32, checkpoint_every: int = 0,
                offload: bool = False) -> nn.Module:
    """Apply `fully_shard` to every decoder block, then to the root; in place.

    The parameters FSDP holds keep the model's dtype (the master weights); forwards compute in
    `param_dtype` and gradients are reduced in fp32. Every `checkpoint_every`-th block recomputes its
    activations in backward (0: none). `offload` keeps the shards on the host."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = {"reshard_after_forward": True,  # the root too (torch's default keeps the root's gathered)
               "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
               "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload
               else OffloadPolicy()}
    blocks = checkpoint_blocks(model, checkpoint_every) if checkpoint_every else decoder_blocks(model)
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def full_state_dict(model: nn.Module, frozen: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded parameters on every rank, without the frozen ones unless `frozen` (a collective: all ranks
    must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=not frozen))


# ---------------------------------------------------------------------------- loading once per trainer


@contextmanager
def parameters_on_meta():
    """Modules built within hold their parameters on the meta device (a shape and a dtype, no memory and no
    values) and their buffers as their constructors compute them: those that no checkpoint holds (rotary
    frequencies) keep their values."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # attributes a constructor set on it
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_dtype(model_dir: str | Path) -> torch.dtype:
    """The dtype the checkpoint in `model_dir` stores its weights in, as its config.json declares it (`dtype`,
    or the older `torch_dtype`, on the model's or its text model's config); float32 if it does not."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    for declared in (getattr(config, "dtype", None), getattr(config.get_text_config(), "dtype", None)):
        declared = getattr(torch, declared, None) if isinstance(declared, str) else declared
        if isinstance(declared, torch.dtype):
            return declared
    return torch.float32


def build_model(model_dir: str | Path, dtype: torch.dtype) -> nn.Module:
    """The transformers model of the checkpoint in `model_dir` (`load_model`'s class) in `dtype`, its weights
    as its constructor makes them (on the meta device within `parameters_on_meta`); no weight is read."""
    from transformers import AutoConfig, GenerationConfig

    from molt_agents.hf_model import model_class

    model = model_class(model_dir).from_config(AutoConfig.from_pretrained(str(model_dir)), dtype=dtype)
    if (Path(model_dir) / "generation_config.json").exists():  # as `from_pretrained` takes it (checkpoints save it)
        model.generation_config = GenerationConfig.from_pretrained(str(model_dir))
    return model


def fill_from_rank0(model: nn.Module, state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Materialise on `device` a model sharded on the meta device and fill it from `state`, the full state
    dict that rank 0 holds (the other ranks pass {}; a collective): broadcast one tensor at a time, each rank
    copying its shards in, cast to the model's dtypes. The buffers keep the values they were built with
    (`parameters_on_meta`), persistent ones then take rank 0's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    built = dict(model.named_buffers())
    model.to_empty(device=device)  # uninitialised memory for the shards and buffers
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(built[name])
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
