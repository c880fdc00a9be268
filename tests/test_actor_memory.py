"""The actor's precision and memory options: bf16 mixed precision, activation checkpointing, CPU offload.

Each test runs the real `PolicyRank` (a 1-rank gloo group in this process,
the real tiny models, FSDP2 sharding) twice from the same weights on the same
packed micro-batch, once with the option and once without, and compares.
Chunked logprobs use a Qwen3 built here with a 50k vocabulary.

Activation memory is measured deterministically, not from the allocator: the
bytes of the tensors autograd saves for backward during the training forward
(`saved_tensors_hooks`; parameters and repeated storages not counted), plus,
with checkpointing, the block inputs the checkpoint keeps to recompute from.
Logits memory is the largest [*, vocab] tensor any op of the step creates
(a `TorchDispatchMode` sees every op's output).
"""

import math
import socket

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from molt_train.actor.policy import PolicyRank
from molt_train.config import ActorConfig, AlgoConfig, Config, TrainConfig
from molt_train.packing import TrainItem, pack

LR = 1e-3


def _micro_batch(vocab: int, routes_shape: tuple[int, int, int] | None = None):
    """Two sequences (20 and 24 tokens) packed into one micro-batch, the second half of each trained.
    For a MoE model, routes that send every token to random experts (not the router's own choice)."""
    generator = np.random.default_rng(0)
    items = []
    for length, advantage in ((20, 1.0), (24, -0.5)):
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        routes = None
        if routes_shape is not None:
            layers, top_k, experts = routes_shape
            routes = np.stack([generator.permutation(experts)[:top_k] for _ in range(length * layers)])
            routes = routes.reshape(length, layers, top_k).astype(np.int16)
        items.append(TrainItem(token_ids=generator.integers(3, vocab, length).tolist(), mask=mask,
                               logprobs=[-1.0 if m else None for m in mask], ages=[0] * length,
                               advantage=advantage, routes=routes))
    (mb,) = pack(items, token_budget=4096)
    assert mb.rows == 2, "the two sequences should share one micro-batch, a row each"
    return mb


def _rank(model_dir, entropy_coef: float = 0.0, train: TrainConfig | None = None, start_dir=None,
          **actor) -> PolicyRank:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    train = train or TrainConfig(lr=LR, lr_schedule="constant", grad_clip=1e9)
    return PolicyRank(str(model_dir), str(start_dir or model_dir), 0, 1, f"tcp://127.0.0.1:{port}",
                      Config(train=train, algo=AlgoConfig(kl_coef=0.0, entropy_coef=entropy_coef),
                             actor=ActorConfig(**actor), steps=1))


def _batch_for(rank: PolicyRank):
    """The test micro-batch for the rank's model; for a MoE with routes to replay."""
    config, routes_shape = rank.model.config, None
    if rank.routing is not None:
        routes_shape = (len(rank.routing.routers), rank.routing.routers[0].top_k, config.num_experts)
    return _micro_batch(config.vocab_size, routes_shape)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


class _LargestVocabTensor(TorchDispatchMode):
    """Bytes of the largest logits-shaped tensor ([..., vocab], not a view) that any op creates; the output
    head's weight and its gradient ([hidden, vocab] transposed) are left out."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden, self.bytes = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if (torch.is_tensor(tensor) and tensor.dim() and tensor.shape[-1] == self.vocab and tensor._base is None
                    and tensor.numel() != self.vocab * self.hidden):
                self.bytes = max(self.bytes, tensor.numel() * tensor.element_size())
        return out


def _run(model_dir, entropy_coef: float = 0.0, **actor) -> dict:
    """One training step; the loss, the logprobs before it, the gradients the optimizer stepped with, the
    weights after, the optimizer state's devices, the activation bytes saved for backward and the largest
    logits-shaped tensor of the step."""
    rank = _rank(model_dir, entropy_coef, **actor)
    try:
        config = rank.model.config
        mb = _batch_for(rank)
        names = {id(p): _clean(name) for name, p in rank.model.named_parameters()}
        grads = {}
        rank.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: grads.update(
            {names[id(p)]: _full(p.grad).detach().clone() for p in rank.model.parameters() if p.grad is not None}))
        seen, saved = set(), [0]

        def pack_hook(tensor):
            key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
            if not isinstance(tensor, torch.nn.Parameter) and key not in seen:
                seen.add(key)
                saved[0] += key[1]
            return tensor

        prepared = rank.logprobs([mb])
        largest = _LargestVocabTensor(config.vocab_size, config.hidden_size)
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda tensor: tensor), largest:
            stats, _ = rank.train([mb], prepared, step_tokens=int(mb.mask.sum()))
        every = {"full": 1, "selective": 2}.get(actor.get("activation_checkpointing"))
        if every:  # each checkpointed block's input hidden states, kept by checkpoint
            saved[0] += len(range(0, config.num_hidden_layers, every)) * mb.num_tokens * config.hidden_size * 4
        weights = rank.full_weights()
        return {"loss": stats.loss_sum, "logprobs": prepared[0].old, "largest_vocab_bytes": largest.bytes,
                "grads": grads, "weights": weights, "saved_bytes": saved[0],
                "param_dtypes": {p.dtype for p in rank.model.parameters()},
                "state_devices": {v.device for s in rank.optimizer.state.values() for v in s.values()
                                  if torch.is_tensor(v) and v.dim() > 0},
                "state_dtypes": {v.dtype for s in rank.optimizer.state.values() for v in s.values()
                                 if torch.is_tensor(v) and v.dim() > 0},
                "device": rank.device}
    finally:
        rank.close()


def _relative(a: dict, b: dict) -> float:
    """|a - b| / |b|, norms over all the tensors together."""
    difference = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
    return (difference / sum(float(b[k].pow(2).sum()) for k in b)) ** 0.5


def test_bf16_step_stays_close_to_fp32_with_fp32_master_weights(dense_dir):
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).state_dict()
    fp32 = _run(dense_dir)
    bf16 = _run(dense_dir, param_dtype="bfloat16")
    loss_rel = abs(bf16["loss"] - fp32["loss"]) / abs(fp32["loss"])
    weights_rel = _relative(bf16["weights"], fp32["weights"])
    update_rel = _relative({k: bf16["weights"][k] - start[k] for k in start},
                           {k: fp32["weights"][k] - start[k] for k in start})
    print(f"bf16 vs fp32 step: loss {bf16['loss']:.6f} vs {fp32['loss']:.6f} (relative {loss_rel:.2e}); "
          f"updated weights relative {weights_rel:.2e}; the update itself relative {update_rel:.2e}")
    # The loss is a sum of +-advantage-weighted ratios, so its relative error is larger than bf16's 4e-3.
    # Adam's first update is about lr * sign(gradient): bf16 flips the sign of the smallest gradients.
    assert 0 < loss_rel < 5e-2, "bf16 compute should change the loss a little, not at all or a lot"
    assert weights_rel < 2e-3 and update_rel < 0.3
    assert bf16["param_dtypes"] == {torch.float32} and bf16["state_dtypes"] == {torch.float32}
    assert {tensor.dtype for tensor in bf16["weights"].values()} == {torch.float32}  # engines, checkpoints


@pytest.mark.parametrize("kind,backend", [("dense", "fsdp2"), ("moe", "fsdp2"), ("moe", "automodel")])
def test_activation_checkpointing_keeps_gradients_and_saves_less(kind, backend, dense_dir, moe_dir):
    """On the MoE models (transformers', and AutoModel's own class) the routes replayed (random experts)
    must also hold in backward's recompute."""
    model_dir = moe_dir if kind == "moe" else dense_dir
    plain = _run(model_dir, backend=backend)
    checkpointed = _run(model_dir, backend=backend, activation_checkpointing="full")
    assert plain["grads"].keys() == checkpointed["grads"].keys()
    worst = _relative(checkpointed["grads"], plain["grads"])
    print(f"{kind}/{backend}: checkpointed vs plain gradients relative {worst:.2e}; saved for backward "
          f"{plain['saved_bytes'] / 2**20:.2f} MiB plain, {checkpointed['saved_bytes'] / 2**20:.2f} MiB checkpointed")
    assert worst <= 1e-6
    assert checkpointed["saved_bytes"] < plain["saved_bytes"]
    if backend == "fsdp2":
        selective = _run(model_dir, activation_checkpointing="selective")
        worst = _relative(selective["grads"], plain["grads"])
        print(f"{kind}/{backend}: selective (every other block) gradients relative {worst:.2e}; saved for "
              f"backward {selective['saved_bytes'] / 2**20:.2f} MiB")
        assert worst <= 1e-6
        assert checkpointed["saved_bytes"] < selective["saved_bytes"] < plain["saved_bytes"]


def test_full_offload_keeps_optimizer_state_on_host_and_equal_results(dense_dir):
    plain = _run(dense_dir)
    offloaded = _run(dense_dir, offload="full")
    assert plain["state_devices"] == {plain["device"]}
    assert offloaded["state_devices"] == {torch.device("cpu")}
    worst = max(float((offloaded["weights"][k] - plain["weights"][k]).abs().max()) for k in plain["weights"])
    print(f"offload full vs none: weights after the step differ by {worst:.2e}; optimizer state on "
          f"{offloaded['state_devices']}")
    assert worst <= 1e-6


# Warmup then decay, decoupled weight decay and a clip below the gradients' norm: each acts at every step.
OFFLOAD_TRAIN = TrainConfig(lr=1e-4, lr_schedule="linear", warmup_steps=2, weight_decay=0.1, grad_clip=0.005)


def _optimizer_states(rank: PolicyRank) -> dict[str, dict[str, torch.Tensor]]:
    """Every trained parameter's optimizer state tensors (a copy), by parameter name."""
    names = {id(p): _clean(name) for name, p in rank.model.named_parameters()}
    return {names[id(p)]: {key: value.detach().clone() for key, value in state.items() if torch.is_tensor(value)}
            for p, state in rank.optimizer.state.items()}


def _steps(rank: PolicyRank, mb, prepared: list[dict], steps: int) -> list:
    """`steps` optimizer steps on one micro-batch against the same old logprobs (PPO epochs), so that the
    loss after the first step depends on the updated weights."""
    return [rank.train([mb], prepared, step_tokens=int(mb.mask.sum()))[0] for _ in range(steps)]


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_optimizer_offload_keeps_adam_state_on_host_and_equal_results(dense_dir, param_dtype):
    """Three steps with the AdamW states and master weights on the host (`--actor.offload optimizer`)
    against AdamW beside the parameters, with the lr schedule, weight decay and clipping acting."""
    runs = {}
    for offload in ("none", "optimizer"):
        rank = _rank(dense_dir, train=OFFLOAD_TRAIN, offload=offload, param_dtype=param_dtype)
        try:
            mb = _batch_for(rank)
            stats = _steps(rank, mb, rank.logprobs([mb]), steps=3)
            params = {_clean(name): p for name, p in rank.model.named_parameters()}
            runs[offload] = {"losses": [s.loss_sum for s in stats], "grad_norms": [s.grad_norm for s in stats],
                             "weights": rank.full_weights(), "states": _optimizer_states(rank),
                             "state_types": {type(v) for s in rank.optimizer.state.values() for v in s.values()
                                             if torch.is_tensor(v) and v.dim() > 0},
                             "param_types": {type(p) for p in params.values()},
                             "shard_shapes": {name: p.to_local().shape for name, p in params.items()},
                             "devices": {p.device for p in params.values()} | {rank.device},
                             "lr": rank.optimizer.param_groups[0]["lr"]}
        finally:
            rank.close()
    plain, offloaded = runs["none"], runs["optimizer"]
    # Parameters stay the FSDP2 DTensors on the training device; only the optimizer's tensors move.
    assert plain["param_types"] == offloaded["param_types"] == {DTensor}
    assert len(offloaded["devices"]) == 1
    assert plain["state_types"] == {DTensor}  # beside the parameters, sharded like them
    assert offloaded["state_types"] == {torch.Tensor}  # plain tensors in host memory: this rank's shards
    for name, state in offloaded["states"].items():
        assert set(state) == {"step", "master", "exp_avg", "exp_avg_sq"}
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert state[key].device == torch.device("cpu") and state[key].dtype == torch.float32
            assert state[key].shape == offloaded["shard_shapes"][name]
            assert state[key].is_pinned() == torch.cuda.is_available()
    # The clip and the schedule acted: the gradients were longer than the clip, the lr reached its end.
    assert min(plain["grad_norms"]) > OFFLOAD_TRAIN.grad_clip
    assert plain["lr"] == offloaded["lr"] == pytest.approx(OFFLOAD_TRAIN.lr * OFFLOAD_TRAIN.min_lr_ratio)
    loss = max(abs(a - b) / abs(b) for a, b in zip(offloaded["losses"], plain["losses"]))
    weights = max(float((offloaded["weights"][k] - plain["weights"][k]).abs().max()) for k in plain["weights"])
    moments = max(float((offloaded["states"][k][m] - _full(plain["states"][k][m]).cpu()).abs().max())
                  for k in plain["states"] for m in ("exp_avg", "exp_avg_sq"))
    print(f"offload optimizer vs none ({param_dtype}, 3 steps): losses {offloaded['losses']} vs {plain['losses']} "
          f"(max relative difference {loss:.2e}); weights max abs difference {weights:.2e}; AdamW moments "
          f"{moments:.2e}; gradient norms {plain['grad_norms']} clipped to {OFFLOAD_TRAIN.grad_clip}")
    assert len(set(plain["losses"])) == 3, "the loss should change as the weights do"
    assert loss <= 1e-6 and weights <= 1e-6 and moments <= 1e-6


def test_optimizer_offload_checkpoint_restores_the_host_state(dense_dir, tmp_path):
    """Save after one step; a run resumed from the checkpoint has the same AdamW state (on the host with
    offload, beside the parameters without: the format is torch's either way) and takes the same second
    step as the run that went on."""
    rank = _rank(dense_dir, train=OFFLOAD_TRAIN, offload="optimizer")
    try:
        mb = _batch_for(rank)
        prepared = rank.logprobs([mb])
        _steps(rank, mb, prepared, steps=1)
        rank.save(str(tmp_path))
        saved = _optimizer_states(rank)
        _steps(rank, mb, prepared, steps=1)
        continued = rank.full_weights()
    finally:
        rank.close()
    for offload in ("optimizer", "none"):
        resumed = _rank(dense_dir, train=OFFLOAD_TRAIN, start_dir=tmp_path / "policy", offload=offload)
        try:
            resumed.restore(str(tmp_path))
            restored = _optimizer_states(resumed)
            _steps(resumed, mb, prepared, steps=1)
            weights = resumed.full_weights()
        finally:
            resumed.close()
        assert restored.keys() == saved.keys()
        keys = ("step", "exp_avg", "exp_avg_sq") + (("master",) if offload == "optimizer" else ())
        state = max(float((_full(restored[k][key]).cpu() - saved[k][key]).abs().max()) for k in saved for key in keys)
        after = max(float((weights[k] - continued[k]).abs().max()) for k in continued)
        print(f"offload optimizer checkpoint resumed with offload {offload}: restored state max abs difference "
              f"{state:.2e}; weights after the next step {after:.2e}")
        assert state == 0 and after <= 1e-6
        if offload == "optimizer":
            assert all(type(value) is torch.Tensor and value.device == torch.device("cpu")
                       for tensors in restored.values() for value in tensors.values())


@pytest.fixture(scope="module")
def large_vocab_dir(tmp_path_factory):
    """A Qwen3 with a 50k vocabulary and a 64-wide body: its logits dwarf its activations."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=50_000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                         max_position_embeddings=256)
    path = tmp_path_factory.mktemp("large_vocab")
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def test_chunked_logprobs_equal_unchunked_without_whole_logits(large_vocab_dir):
    whole = _run(large_vocab_dir, entropy_coef=0.01)
    chunked = _run(large_vocab_dir, entropy_coef=0.01, logprob_chunk_tokens=8)
    logprobs = float((chunked["logprobs"] - whole["logprobs"]).abs().max() / whole["logprobs"].abs().max())
    grads = _relative(chunked["grads"], whole["grads"])
    print(f"chunks of 16 vs whole: logprobs relative {logprobs:.2e}, loss {chunked['loss']:.8f} vs "
          f"{whole['loss']:.8f}, gradients relative {grads:.2e}; largest [*, vocab] tensor "
          f"{whole['largest_vocab_bytes'] / 2**20:.2f} MiB whole, {chunked['largest_vocab_bytes'] / 2**20:.2f} MiB "
          f"chunked; saved for backward {whole['saved_bytes'] / 2**20:.2f} MiB whole, "
          f"{chunked['saved_bytes'] / 2**20:.2f} MiB chunked")
    assert logprobs <= 1e-6 and grads <= 1e-6
    assert abs(chunked["loss"] - whole["loss"]) <= 1e-6 * abs(whole["loss"])
    assert chunked["largest_vocab_bytes"] < whole["largest_vocab_bytes"] / 2
    assert chunked["saved_bytes"] < whole["saved_bytes"] / 2
    # Unchunked, the head still maps only the positions that predict a trained token (22 of the 48).
    mb = _micro_batch(50_000)
    assert whole["largest_vocab_bytes"] == int(mb.mask.sum()) * 50_000 * 4 < mb.num_tokens * 50_000 * 4


@pytest.mark.parametrize("refused,flag,runs", [
    ({"logprob_chunk_tokens": -1}, "actor.logprob_chunk_tokens", {"logprob_chunk_tokens": 1024}),
    ({"backend": "automodel", "param_dtype": "bfloat16"}, "actor.param_dtype",
     {"backend": "automodel", "param_dtype": "bfloat16", "world_size": 2}),
    ({"backend": "automodel", "offload": "full"}, "actor.offload",
     {"backend": "automodel", "offload": "full", "world_size": 2}),
    ({"backend": "automodel", "offload": "full"}, "actor.offload", {"backend": "automodel", "offload": "optimizer"}),
    ({"backend": "automodel", "activation_checkpointing": "selective"}, "actor.activation_checkpointing",
     {"activation_checkpointing": "selective"})])
def test_combinations_that_cannot_run_are_refused_naming_the_flag(refused, flag, runs):
    """AutoModel's parallelizers leave a single data-parallel rank unsharded, so FSDP's mixed precision and
    offload policies would silently not apply (the host optimizer steps plain tensors as well); its
    checkpointing is all blocks or none."""
    from molt_train.config import Config, ConfigError, validate

    with pytest.raises(ConfigError, match=flag):
        validate(Config(actor=ActorConfig(**refused)))
    validate(Config(actor=ActorConfig(**runs)))


def test_molt_train_runs_in_bf16_with_selective_checkpointing_and_chunks(tmp_path, ray_address):
    from test_train import _train

    rows = _train(tmp_path / "run", ray_address, "--steps", "2", "--train.async_queue_size", "0",
                  "--actor.param_dtype", "bfloat16", "--actor.activation_checkpointing", "selective",
                  "--actor.logprob_chunk_tokens", "32")
    print("bf16 run: mismatch/max_abs per step", [row["mismatch/max_abs"] for row in rows])
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["loss"]) for row in rows)
