"""Routing replay on the tiny MoE on CUDA: the trainer's model class trained one step replaying routes.

On CPU (tests/test_routing_replay.py) both classes that train a MoE run:
transformers' own, and with the AutoModel backend NeMo AutoModel's native one
(`automodel.load_native`, on AutoModel's plain-torch kernels there); here
each runs on the GPU. Routes come from the transformers model of the same
checkpoint (fp32): the class under test, replaying them, must agree with its
own choice everywhere (agreement 1.0), give the same logprobs (1e-4), and the
router must still get gradients through the replayed gates.

`nemo-automodel` cannot share an environment with `vllm` on GPU (conflicting
`quack-kernels` pins); `scripts/setup.sh` installs it without its
dependencies, and where it then does not import (or is not installed, as on
the lent GPU machine), its case skips and says so.
"""

import pytest
import torch

from .conftest import CUDA, on_device

pytestmark = pytest.mark.skipif(not CUDA, reason="no CUDA: routing replay on CUDA check")


@pytest.mark.parametrize("backend", ["transformers", "automodel"])
def test_moe_step_on_cuda_with_routing_replay(backend, moe_dir, record_property):
    if backend == "automodel":
        pytest.importorskip("nemo_automodel", reason="cannot run in this Python: nemo_automodel does not import "
                                                     "(the lent GPU machine has none; beside vllm on GPU it "
                                                     "installs without its dependencies)")
    from transformers import AutoModelForCausalLM

    from molt_agents.hf_model import load_model
    from molt_train.actor import automodel
    from molt_train.actor.policy import token_logprobs
    from molt_train.actor.routing_replay import RoutingReplay
    from molt_train.packing import TrainItem, pack

    reference = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).cuda()
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(5, reference.config.vocab_size, (n,), generator=generator).tolist() for n in (40, 57)]
    chosen = []
    hooks = [m.register_forward_hook(lambda mod, a, out: chosen.append(out[-1]))
             for m in reference.modules() if type(m).__name__.endswith("TopKRouter")]
    items = []
    for ids in sequences:
        chosen.clear()
        with torch.no_grad():
            logits = reference(torch.tensor([ids], device="cuda")).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0]
        routes = torch.stack(chosen, 1).cpu().numpy().astype("int16")  # [T, layers, top_k]
        items.append(TrainItem(token_ids=ids, mask=[0] + [1] * (len(ids) - 1), logprobs=[None] + logprobs.tolist(),
                               ages=[0] * len(ids), advantage=1.0, routes=routes))
    for hook in hooks:
        hook.remove()
    (mb,) = pack(items, token_budget=4096)
    mb = on_device(mb, "cuda")

    model = (automodel.load_native(moe_dir) if backend == "automodel" else load_model(moe_dir, torch.float32)).cuda()
    assert automodel.is_native(model) == (backend == "automodel")
    routing = RoutingReplay(model, replay=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with routing.use(mb.routes, measure=True):
        logprobs, _ = token_logprobs(model, mb)
    mask = mb.mask.bool()
    worst = (logprobs - mb.engine_logprobs)[mask].abs().max().item()
    loss = -(logprobs * mb.advantages * mb.mask).sum() / mb.mask.sum()
    loss.backward()
    router_grad = sum(float(gate.weight.grad.abs().sum()) for gate in routing.routers
                      if getattr(gate, "weight", None) is not None and gate.weight.grad is not None)
    optimizer.step()
    hits, compared = routing.take_agreement()
    record_property("replay_agreement", hits / compared)
    record_property("max_abs_logprob_delta", worst)
    record_property("router_grad_abs_sum", router_grad)
    print(f"{backend} {type(model).__name__} on CUDA: replay agreement {hits}/{compared} = {hits / compared:.4f}, "
          f"max |replayed - transformers| logprob {worst:.2e}, router |grad| sum {router_grad:.3e}, "
          f"loss {loss.item():.4f}")
    assert hits / compared == 1.0
    assert worst < 1e-4
    assert torch.isfinite(loss) and router_grad > 0
