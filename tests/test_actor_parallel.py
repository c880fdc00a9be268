"""Actor parallelism with NeMo AutoModel: a tensor-, context- or expert-parallel step equals the unsharded one.

Real processes run the real `PolicyRank` (a gloo group, AutoModel's device
mesh and parallelizers): two with `--actor.tensor_parallel 2` on a dense
Qwen3 built here with two key-value heads (the tiny model has one, which two
ranks cannot split); two with `--actor.context_parallel 2` on the tiny dense
model (each packed row cut in two, one sequence straddling the cut), once
more with activation checkpointing and the chunked output head; four with
both (TP=2 x CP=2); two with `--actor.expert_parallel 2` on the tiny MoE in
AutoModel's own class. Micro-batches go to the ranks as the trainer deals
them: the tensor- and context-parallel ranks of a replica share both, the two
expert-parallel (data-parallel) ranks get one each. One process running the
same step unsharded (the same backend on one rank, which AutoModel leaves
unsharded) is the reference.
"""

import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from molt_train.actor.policy import PolicyRank, StepStats
from molt_train.config import ActorConfig, AlgoConfig, Config, ConfigError, TrainConfig, validate
from molt_train.packing import TrainItem, deal, pack

WORLD = 2
LR = 1e-3


def _micro_batches(vocab: int) -> list:
    """Two micro-batches of two packed sequences each, the second half of each sequence trained (rows of 43
    and 39 tokens: context parallel pads them)."""
    generator = np.random.default_rng(0)
    items = []
    for length, advantage in ((20, 1.0), (23, -0.5), (18, 0.5), (21, -1.0)):
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        items.append(TrainItem(token_ids=generator.integers(3, vocab, length).tolist(), mask=mask,
                               logprobs=[-1.0 if m else None for m in mask], ages=[0] * length,
                               advantage=advantage))
    micro_batches = pack(items, token_budget=48)
    assert len(micro_batches) == 2
    return micro_batches


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(rank: int, world_size: int, model_dir: str, actor: ActorConfig, init_method: str, out_dir: str):
    """One `PolicyRank.step` on this rank's deal of the micro-batches; writes its stats (and on rank 0 the
    weights after the step)."""
    policy = PolicyRank(model_dir, model_dir, rank, world_size, init_method,
                        Config(train=TrainConfig(lr=LR, lr_schedule="constant", grad_clip=1e9),
                               algo=AlgoConfig(kl_coef=0.0), actor=actor, steps=1))
    try:
        micro_batches = _micro_batches(policy.model.config.vocab_size)
        step_tokens = int(sum(mb.mask.sum() for mb in micro_batches))
        replica_ranks = world_size // actor.data_parallel
        share = deal(micro_batches, actor.data_parallel)[rank // replica_ranks]
        stats = policy.step(share, step_tokens)
        weights = policy.full_weights()
        torch.save({"stats": stats, "weights": weights, "described": policy.describe()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        policy.close()


def _run(model_dir, out_dir, **actor) -> dict:
    """The step on `world_size` spawned ranks: the group's stats (one rank per replica, as the trainer
    reduces them) and the weights after it."""
    actor = ActorConfig(**actor)
    validate(Config(actor=actor))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_step, args=(actor.world_size, str(model_dir), actor, f"tcp://127.0.0.1:{_port()}",
                                    str(out_dir)), nprocs=actor.world_size, start_method="spawn")
    ranks = [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(actor.world_size)]
    replica_ranks = actor.world_size // actor.data_parallel
    return {"stats": StepStats.reduce([r["stats"] for r in ranks[::replica_ranks]]),
            "weights": ranks[0]["weights"], "described": ranks[0]["described"]}


@pytest.fixture(scope="module")
def two_kv_heads_dir(tmp_path_factory):
    """The tiny dense Qwen3's shape with two key-value heads, so two tensor-parallel ranks can split them."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                         max_position_embeddings=256, initializer_range=0.1)
    path = tmp_path_factory.mktemp("two_kv_heads")
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    """The one-rank step of each model, run once for all the parallel layouts compared with it."""
    runs = {}

    def run(model_dir):
        if model_dir not in runs:
            runs[model_dir] = _run(model_dir, tmp_path_factory.mktemp("plain"), backend="automodel", world_size=1)
        return runs[model_dir]
    return run


# CP runs with checkpointing and chunked logprobs, the hardest case (recompute inside the CP context).
@pytest.mark.parametrize("model,parallel", [
    ("two_kv_heads_dir", {"tensor_parallel": 2}),
    ("dense_dir", {"context_parallel": 2, "activation_checkpointing": "full", "logprob_chunk_tokens": 16}),
    ("two_kv_heads_dir", {"world_size": 4, "tensor_parallel": 2, "context_parallel": 2}),
    ("moe_dir", {"expert_parallel": 2})], ids=["tp", "cp-checkpointed-chunked", "tp-cp", "ep"])
def test_parallel_step_equals_unsharded(model, parallel, request, tmp_path, unsharded):
    model_dir = request.getfixturevalue(model)
    (tmp_path / "parallel").mkdir()
    sharded = _run(model_dir, tmp_path / "parallel", backend="automodel", **{"world_size": WORLD, **parallel})
    plain = unsharded(model_dir)
    before = {}
    for file in model_dir.glob("*.safetensors"):  # the checkpoint's tensors, as the weights leave
        before.update(load_file(file))
    assert sharded["weights"].keys() == plain["weights"].keys() == before.keys()
    assert sharded["stats"].tokens == plain["stats"].tokens
    loss_rel = abs(sharded["stats"].loss_sum - plain["stats"].loss_sum) / abs(plain["stats"].loss_sum)
    # The trainer-vs-engine KL sum is a function of the recomputed logprobs alone (the engine's are fixed).
    kl_rel = abs(sharded["stats"].mismatch_kl_sum - plain["stats"].mismatch_kl_sum) / plain["stats"].mismatch_kl_sum
    moved = max(float((plain["weights"][k] - before[k]).abs().max()) for k in before)
    norm_rel = abs(sharded["stats"].grad_norm - plain["stats"].grad_norm) / plain["stats"].grad_norm
    worst, where = max((float((sharded["weights"][k] - plain["weights"][k]).abs().max()), k) for k in before)
    print(f"{sharded['described']} vs one rank: loss {sharded['stats'].loss_sum:.8f} vs "
          f"{plain['stats'].loss_sum:.8f} (relative {loss_rel:.2e}); logprobs' KL sum to the engine "
          f"{sharded['stats'].mismatch_kl_sum:.8f} vs {plain['stats'].mismatch_kl_sum:.8f} (relative {kl_rel:.2e}); "
          f"gradient norm {sharded['stats'].grad_norm:.6e} "
          f"vs {plain['stats'].grad_norm:.6e} (relative {norm_rel:.2e}); weights moved up to {moved:.2e}, "
          f"differ by up to {worst:.2e} ({worst / moved:.2e} of the largest move; {where})")
    assert moved > 5e-4, "the step did not change the weights; the comparison would be vacuous"
    assert kl_rel <= 1e-6
    assert loss_rel <= 1e-5  # the loss is a small difference of the positive- and negative-advantage terms
    assert norm_rel <= 1e-5  # Adam's first step hides a gradient's scale; its norm does not
    assert worst <= 1e-2 * moved


@pytest.mark.parametrize("actor,flag,message", [
    ({"tensor_parallel": 0}, "actor.tensor_parallel", "must be >= 1"),
    ({"tensor_parallel": 2, "world_size": 2}, "actor.tensor_parallel", "2 needs --actor.backend automodel"),
    ({"context_parallel": 2, "world_size": 2}, "actor.context_parallel", "2 needs --actor.backend automodel"),
    ({"expert_parallel": 2, "world_size": 2}, "actor.expert_parallel", "2 needs --actor.backend automodel"),
    ({"backend": "automodel", "tensor_parallel": 2, "world_size": 3}, "actor.tensor_parallel",
     "2 x --actor.context_parallel 1 does not divide --actor.world_size 3"),
    ({"backend": "automodel", "tensor_parallel": 2, "context_parallel": 2, "world_size": 6}, "actor.tensor_parallel",
     "2 x --actor.context_parallel 2 does not divide --actor.world_size 6"),
    ({"backend": "automodel", "expert_parallel": 4, "world_size": 2}, "actor.expert_parallel",
     "4 does not divide --actor.world_size 2"),
    ({"backend": "automodel", "tensor_parallel": 2, "world_size": 2, "logprob_chunk_tokens": 64},
     "actor.logprob_chunk_tokens", "tensor-parallel")])
def test_parallel_sizes_that_cannot_run_are_refused_naming_the_flag(actor, flag, message):
    with pytest.raises(ConfigError) as error:
        validate(Config(actor=ActorConfig(**actor)))
    assert str(error.value).startswith(f"--{flag}: ") and message in str(error.value), str(error.value)


def test_parallel_sizes_that_fit_give_the_data_parallel_size():
    actor = ActorConfig(backend="automodel", world_size=8, tensor_parallel=2, context_parallel=2, expert_parallel=4)
    validate(Config(actor=actor))
    assert actor.data_parallel == 2


@pytest.mark.parametrize("kind,actor,message", [
    ("dense", {"expert_parallel": 2}, "--actor.expert_parallel: the model in"),  # ... is dense
    ("dense", {"tensor_parallel": 2}, "--actor.tensor_parallel: 2 ranks cannot split the model's 1 heads"),
    ("moe", {"expert_parallel": 3}, "--actor.expert_parallel: 3 ranks cannot share the model's 4 experts")])
def test_parallel_sizes_the_model_cannot_take_are_refused(kind, actor, message, dense_dir, moe_dir):
    from molt_train.model_fit import resolve_from_model

    model_dir = dense_dir if kind == "dense" else moe_dir
    config = Config(actor=ActorConfig(backend="automodel", world_size=6, **actor))
    validate(config)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve_from_model(config, model_dir)
    resolve_from_model(Config(actor=ActorConfig(backend="automodel", world_size=2, expert_parallel=2)), moe_dir)


def test_context_parallel_takes_dense_models_and_expert_parallel_needs_automodels_own_class(dense_dir, moe_dir):
    from transformers import AutoModelForCausalLM

    from molt_train.actor import automodel

    moe = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"--actor.context_parallel: splits the sequences of transformers' dense"):
        automodel.check_parallel(moe, context_parallel=2, expert_parallel=1)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    automodel.check_parallel(dense, context_parallel=2, expert_parallel=1)
    with pytest.raises(ValueError, match="--actor.expert_parallel: NeMo AutoModel has no MoE class of its own"):
        automodel.check_parallel(dense, context_parallel=1, expert_parallel=2)
