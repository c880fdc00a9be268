"""FSDP2 over gloo: one sharded optimizer step equals the same step unsharded; a rank group loads the
checkpoint once, on rank 0, into exactly the weights of a single-process load.

Two real processes, a real gloo process group, the real tiny models, sharded
by our `fully_shard` wrapper and by NeMo AutoModel's parallelizer.

Adam's first step is lr * g / (|g| + eps); its slope in g is largest at g = 0,
lr / eps. With torch's eps of 1e-8 that slope is 1e5, so the last-bit difference
between a sharded and an unsharded reduction of a near-zero gradient (an expert
that saw few tokens) moves a weight by 2e-5, a fiftieth of the whole step, and
the comparison measures summation order. With eps 1e-5 the slope is 100:
rounding moves a weight by under 1e-6, while a real error (a gradient not
averaged over ranks, a shard left out, a wrong optimizer state) still moves it
by a visible fraction of lr = 1e-3. The bound, 1e-5, is 1% of the step.
"""

import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
LR = 1e-3
EPS = 1e-5


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
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
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
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS)
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


def _rank_load(rank: int, model_dirs: list[str], backend: str, init_method: str, out_dir: str) -> None:
    """A `PolicyRank` of a 2-rank group, with a KL reference model, from `model_dirs[rank]`; saves what both
    models hold on this rank: full weights, buffers, parameter dtypes."""
    from molt_train.actor import fsdp
    from molt_train.actor.policy import PolicyRank
    from molt_train.config import ActorConfig, AlgoConfig, Config

    torch.set_num_threads(1)
    policy = PolicyRank(model_dirs[rank], model_dirs[rank], rank, WORLD, init_method,
                        Config(algo=AlgoConfig(kl_coef=0.1), actor=ActorConfig(backend=backend, world_size=WORLD),
                               steps=1))
    try:
        held = {name: {"weights": {k: v.detach().clone() for k, v in fsdp.full_state_dict(model).items()},
                       "buffers": {k: b.detach().clone() for k, b in model.named_buffers()},
                       "param_dtypes": {p.dtype for p in model.parameters()}}
                for name, model in (("policy", policy.model), ("reference", policy.reference))}
        torch.save(held, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        policy.close()


@pytest.mark.parametrize("kind,stored,backend", [
    ("dense", "float32", "fsdp2"), ("dense", "bfloat16", "fsdp2"), ("vlm", "float32", "fsdp2"),
    ("moe", "float32", "automodel"), ("moe", "bfloat16", "automodel")])
def test_a_rank_group_loads_the_checkpoint_once_into_the_weights_of_a_single_process_load(
        kind, stored, backend, tmp_path):
    """Rank 1 gets the model's directory without its weight files, so it cannot have read them: rank 0 alone
    reads the checkpoint and the group fills its shards from it. Both ranks must then hold, for the policy and
    the reference model, exactly the fp32 weights and the buffers (rotary frequencies, which no checkpoint
    holds) of the model loaded in one process. A bf16 checkpoint travels in bf16 and is cast into the fp32
    shards; the MoE is AutoModel's own class, filled through its state-dict adapter (grouped experts)."""
    from molt_agents.hf_model import load_model
    from molt_agents.tiny import tiny_model
    from molt_train.actor import automodel, fsdp

    model_dir = tiny_model(kind)
    if stored != "float32":  # the same model saved in bf16 (its config.json says so)
        model_dir = tmp_path / stored
        load_model(tiny_model(kind), getattr(torch, stored)).save_pretrained(model_dir)
    assert fsdp.checkpoint_dtype(model_dir) == getattr(torch, stored)  # what rank 0 reads the weights in
    no_weights = tmp_path / "no_weights"
    shutil.copytree(model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors*"))
    assert list(model_dir.glob("*.safetensors")) and not list(no_weights.glob("*.safetensors*"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank_load, args=([str(model_dir), str(no_weights)], backend, f"tcp://127.0.0.1:{port}",
                                         str(tmp_path)), nprocs=WORLD, start_method="spawn")

    native = backend == "automodel" and automodel.native_class(model_dir) is not None
    single = automodel.load_native(model_dir) if native else load_model(model_dir, torch.float32)
    weights, buffers = single.state_dict(), dict(single.named_buffers())
    assert {p.dtype for p in single.parameters()} == {torch.float32}
    assert buffers or native, "transformers' models hold rotary frequencies; the buffer check would be vacuous"
    for rank in range(WORLD):
        held = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name, model in held.items():
            where = f"rank {rank}, {name}"
            assert model["param_dtypes"] == {torch.float32}, where
            assert model["weights"].keys() == weights.keys(), where
            different = [k for k, v in weights.items()
                         if model["weights"][k].dtype != v.dtype or not torch.equal(model["weights"][k], v)]
            assert not different, f"{where}: weights differ from the single-process load: {different}"
            assert model["buffers"].keys() == buffers.keys(), where
            different = [k for k, v in buffers.items()
                         if model["buffers"][k].dtype != v.dtype or not torch.equal(model["buffers"][k], v)]
            assert not different, f"{where}: buffers differ from the single-process load: {different}"
