"""FSDP2 over gloo: one sharded optimizer step equals the same step unsharded.

Two real processes, a real gloo process group, the real tiny models, sharded
by our `fully_shard` wrapper and by NeMo AutoModel's parallelizer.

The learning rate is 1e-3: Adam's first step is lr * g / (|g| + eps), so for a
gradient near eps (an expert that saw few tokens has |g| ~ 1e-10) the last-bit
rounding difference between a sharded and an unsharded reduction becomes a
visible fraction of lr. The 1e-5 bound is therefore 1% of the step size.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
LR = 1e-3


def _batch(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (2 * WORLD, 24), generator=generator)


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    logits = getattr(out, "logits", out)[:, :-1].float()  # AutoModel's own classes return the logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _rank_step(rank: int, model_dir: str, backend: str, init_method: str, out_path: str) -> None:
    from molt_train.actor import automodel, fsdp

    torch.manual_seed(0)
    fsdp.init_process_group(rank, WORLD, init_method)
    if backend == "fsdp2":
        model = fsdp.shard_model(_load(model_dir))
    elif backend == "automodel-native":
        model = automodel.shard_model(automodel.load_native(model_dir))
    else:
        model = automodel.shard_model(_load(model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = _batch(model.config.vocab_size).chunk(WORLD)[rank]  # each rank its share of the batch
    _loss(model, ids).backward()  # FSDP averages gradients over ranks = gradient of the batch mean
    optimizer.step()
    state = fsdp.full_state_dict(model)
    if rank == 0:
        torch.save({name: tensor.detach().clone() for key, value in state.items()
                    for name, tensor in automodel.hf_tensors(model, key, value)}, out_path)
    fsdp.destroy_process_group()


@pytest.mark.parametrize("kind,backend", [("dense", "fsdp2"), ("moe", "fsdp2"), ("dense", "automodel"),
                                                  ("moe", "automodel"), ("moe", "automodel-native")])
def test_fsdp2_step_equals_unsharded(kind, backend, tmp_path):
    from molt_agents.tiny import tiny_model

    model_dir = str(tiny_model(kind))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = str(tmp_path / "sharded.pt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank_step, args=(model_dir, backend, f"tcp://127.0.0.1:{port}", out_path),
                       nprocs=WORLD, start_method="spawn")
    sharded = torch.load(out_path)

    reference = _load(model_dir)
    before = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    _loss(reference, _batch(reference.config.vocab_size)).backward()
    optimizer.step()

    after = reference.state_dict()
    if backend == "automodel-native":  # its weights leave in the checkpoint's layout
        from transformers.core_model_loading import revert_weight_conversion

        before, after = revert_weight_conversion(reference, before), revert_weight_conversion(reference, after)
    assert sharded.keys() == after.keys()
    moved = max((after[k] - before[k]).abs().max().item() for k in after)
    assert moved > 5e-4, "the step did not change the weights; the comparison would be vacuous"
    worst = max((sharded[k] - after[k]).abs().max().item() for k in after)
    print(f"{kind}/{backend}: weights moved up to {moved:.2e}; sharded vs unsharded step differ by {worst:.2e}")
    assert worst < 1e-5, f"sharded and unsharded steps differ by {worst:.2e}"
