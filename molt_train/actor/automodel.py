"""NeMo AutoModel as the large-scale actor backend: its FSDP2 parallelizer.

AutoModel's parallelizer applies FSDP2 (and, on GPUs, tensor / sequence /
context parallelism) over a named device mesh. It runs on CPU over gloo, so
the same code path is tested here; its `from_pretrained` needs CUDA and is
used only on GPU machines. On CUDA machines `nemo-automodel` cannot share an
environment with vLLM (conflicting `quack-kernels` pins): there it runs in
the trainer's own environment.
"""

from __future__ import annotations

from torch import nn


def shard_model(model: nn.Module, data_parallel: int, tensor_parallel: int = 1,
                param_dtype=None) -> nn.Module:
    """Shard `model` with AutoModel's `fsdp2_strategy_parallelize` over this process group.

    Parameters are computed in `param_dtype` (default: the model's own dtype;
    AutoModel's default would be bfloat16) and gradients reduced in fp32.
    """
    import torch
    from nemo_automodel.components.distributed.parallelizer import fsdp2_strategy_parallelize
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (1, data_parallel, tensor_parallel),
                            mesh_dim_names=("dp_replicate", "dp_shard_cp", "tp"))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype or next(model.parameters()).dtype,
                                  reduce_dtype=torch.float32, output_dtype=torch.float32)
    return fsdp2_strategy_parallelize(model, mesh, mp_policy=policy)
