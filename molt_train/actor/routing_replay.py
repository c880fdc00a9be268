"""Routing replay: the actor's MoE layers send each token to the experts the engine chose.

The engine and the trainer can route one token to different experts (other
kernels, other precision, a router that moved between syncs); then the
trainer's logprobs are not the engine's and importance sampling throws the
tokens away. The trajectory carries the engine's top-k expert ids per
position and layer (`routes`, -1 where unknown); during the actor's forward a
hook on every top-k router replaces the router's own choice with them. Only
the choice is replayed: the gate weights are recomputed from the live router
logits at the replayed experts, so the router still gets gradients. A row with
any -1 keeps the live choice.

The same hooks measure how often the trainer's own top-k agrees with the
engine's (the `routing/agreement` metric), replay on or off.

Supported routers: transformers' softmax top-k routers, which return
`(router_logits, top_k_weights, top_k_indices)` (Qwen2/Qwen3-MoE, OLMoE,
Mixtral and the models built like them); and NeMo AutoModel's own MoE
models, whose every `Gate` asks a `RouterReplay` handle for its selection
(`gate.router_replay.apply(live_ids)`) and re-gathers the live scores at the
ids it gets back. There the hook is such a handle (`_GateReplay`), which adds
what AutoModel's lacks: the -1 fallback to live routing and the agreement count.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from molt_agents.hf_model import router_modules

def automodel_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """NeMo AutoModel's MoE gates (its native MoE models), in layer order (empty for other models)."""
    return [m for m in model.modules() if type(m).__name__ == "Gate" and hasattr(m, "router_replay")]


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers: transformers' routers, else AutoModel's gates."""
    return router_modules(model) or automodel_gates(model)


def replayed_gates(router_logits: torch.Tensor, indices: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Gate weights of the chosen experts: softmax over all experts, taken at `indices` [N, k]
    (renormalised over the k when the model does), differentiable in the logits."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    gates = probs.gather(-1, indices)
    if normalize:
        gates = gates / gates.sum(-1, keepdim=True)
    return gates.to(router_logits.dtype)


def agreement(live: torch.Tensor, captured: torch.Tensor) -> tuple[int, int]:
    """(experts of `captured` [N, k] that the live choice [N, k] also picked, experts compared),
    over rows whose captured ids are all known."""
    known = (captured >= 0).all(-1)
    live, captured = live[known], captured[known]
    hits = (live[:, :, None] == captured[:, None, :]).any(-1).sum()
    return int(hits), int(captured.numel())


def freeze_routers(model: torch.nn.Module) -> list[str]:
    """Stop the router weights from training (`actor.freeze_moe_router`); returns their names."""
    routers, names = {id(router) for router in moe_routers(model)}, []
    for name, module in model.named_modules():
        if id(module) in routers:
            module.requires_grad_(False)
            names += [f"{name}.{p}" for p, _ in module.named_parameters()]
    return names


class RoutingReplay:
    """Hooks on a model's top-k routers; `use(routes)` around a forward replays (or just measures) them."""

    def __init__(self, model: torch.nn.Module, replay: bool):
        self.routers = router_modules(model)
        for router in self.routers:
            if not hasattr(router, "top_k"):
                raise ValueError(f"routing replay does not support {type(router).__name__} (no top_k)")
        self.replay = replay
        self.routes: torch.Tensor | None = None  # [N, layers, top_k] for the forward in progress
        self.hits = self.compared = 0
        self.handles = [router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(self.routers)]
        if not self.routers:  # NeMo AutoModel's gates: stand in for their RouterReplay handles
            self.routers = automodel_gates(model)
            for layer, gate in enumerate(self.routers):
                gate.top_k, gate.router_replay = gate.topk, _GateReplay(self, layer)

    @contextmanager
    def use(self, routes: torch.Tensor | None, measure: bool = False):
        """Forwards inside use this micro-batch's captured routes ([N, layers, top_k] or None)."""
        if routes is not None and routes.shape[1:] != (len(self.routers), self.routers[0].top_k):
            raise ValueError(f"routes of shape {tuple(routes.shape)} do not fit this model's "
                             f"{len(self.routers)} MoE layers x top-{self.routers[0].top_k}")
        self.routes, self.measure = (None if routes is None else routes.long()), measure
        try:
            yield
        finally:
            self.routes = None

    def take_agreement(self) -> tuple[int, int]:
        """(hits, compared) counted since the last call."""
        counts, self.hits, self.compared = (self.hits, self.compared), 0, 0
        return counts

    def choose(self, layer: int, live: torch.Tensor) -> torch.Tensor:
        """The experts layer `layer` uses, given its live top-k ids [N, k]: the engine's where known."""
        captured = self.routes[:, layer].to(live.device)
        if captured.shape != live.shape:
            raise ValueError(f"routes for {tuple(captured.shape)} (tokens, top_k) in MoE layer {layer}, "
                             f"which routes {tuple(live.shape)}")
        if self.measure:
            hits, compared = agreement(live, captured)
            self.hits, self.compared = self.hits + hits, self.compared + compared
        if not self.replay:
            return live
        return torch.where((captured >= 0).all(-1, keepdim=True), captured, live)

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if self.routes is None:
                return output
            router_logits, gates, live = output
            indices = self.choose(layer, live)
            if indices is live:
                return output
            return router_logits, replayed_gates(router_logits, indices, getattr(module, "norm_topk_prob", True)), indices

        return hook


class _GateReplay:
    """In place of an AutoModel `Gate`'s `RouterReplay`: the gate passes its live top-k ids to `apply`
    and, given other ids back, gathers their weights from the live scores (so the router still learns)."""

    def __init__(self, owner: RoutingReplay, layer: int):
        self.owner, self.layer = owner, layer

    def apply(self, indices: torch.Tensor) -> torch.Tensor:
        if self.owner.routes is None:
            return indices
        return self.owner.choose(self.layer, indices)
