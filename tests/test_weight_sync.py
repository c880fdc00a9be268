"""The bucketed weight broadcast: the bucket plan, the channel across real processes over gloo, and the
sync in the engine's dtype.

On GPU the same channel runs on NCCL; this machine has no GPU, so the
collective here is gloo (the end-to-end runs in test_train use it too).
"""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import run

from molt_train.weight_sync import ALIGN, Bucket, Channel, TensorMeta, plan_buckets, sync_dtype, sync_metas, tensor_meta


def test_plan_packs_consecutive_tensors_aligned_and_a_large_one_alone():
    a = TensorMeta("a", (3,), "float32")  # 12 bytes, padded to 16
    b = TensorMeta("b", (4, 4), "float32")  # 64 bytes
    c = TensorMeta("c", (5,), "bfloat16")  # 10 bytes
    big = TensorMeta("big", (50,), "float32")  # 200 bytes: over the budget, alone
    d = TensorMeta("d", (2,), "int64")  # 16 bytes
    assert ALIGN == 16
    assert plan_buckets([a, b, c, big, d], bucket_bytes=80) == [
        Bucket(80, ((a, 0), (b, 16))),
        Bucket(16, ((c, 0),)),
        Bucket(208, ((big, 0),)),
        Bucket(16, ((d, 0),)),
    ]
    assert plan_buckets([a, b, c], bucket_bytes=1 << 20) == [Bucket(96, ((a, 0), (b, 16), (c, 80)))]
    assert plan_buckets([], 80) == []


def test_tensor_meta_reads_names_shapes_dtypes():
    assert tensor_meta([("w", torch.zeros(2, 3, dtype=torch.bfloat16))]) == [TensorMeta("w", (2, 3), "bfloat16")]


def test_sync_metas_carry_floating_point_weights_in_the_engine_dtype():
    metas = tensor_meta(_weights().items())
    bf16 = sync_metas(metas, torch.bfloat16)
    assert [m.dtype for m in bf16] == ["bfloat16", "bfloat16", "bfloat16", "int64", "bfloat16"]
    assert [(m.name, m.shape) for m in bf16] == [(m.name, m.shape) for m in metas]
    assert [m.dtype for m in sync_metas(metas, torch.float32)] == ["float32", "float32", "float32", "int64",
                                                                   "float32"]
    assert sum(b.size for b in plan_buckets(bf16, 1 << 20)) < sum(b.size for b in plan_buckets(metas, 1 << 20))


def _weights():
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(37, 8, generator=generator),
        "norm.weight": torch.randn(8, generator=generator).to(torch.bfloat16),
        "layers.0.proj.weight": torch.randn(8, 24, generator=generator),
        "step": torch.tensor([7, -3], dtype=torch.int64),
        "lm_head.weight": torch.randn(37, 8, generator=generator),
    }


def _party(rank, size, port, results, engine_dtype):
    torch.set_num_threads(1)
    weights = _weights()
    buckets = plan_buckets(sync_metas(tensor_meta(weights.items()), engine_dtype), bucket_bytes=1200)
    channel = Channel("127.0.0.1", port, rank, size, torch.device("cpu"), timeout=60)
    if rank == 0:
        for bucket in buckets:
            channel.send(bucket, weights)
        results.put((rank, len(buckets), True))
        return
    received = {name: tensor.clone() for name, tensor in channel.receive(buckets)}
    sent = {k: v.to(sync_dtype(v.dtype, engine_dtype)) for k, v in weights.items()}  # what the sender cast
    exact = list(received) == list(sent) and all(
        received[k].dtype == v.dtype and torch.equal(received[k], v) for k, v in sent.items())
    results.put((rank, len(buckets), exact))


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16])
def test_channel_broadcasts_every_bucket_exactly_to_every_receiver(engine_dtype):
    from molt_train.weight_sync import free_endpoint

    _, port = free_endpoint()
    context = mp.get_context("spawn")
    results = context.Queue()
    size = 3  # the trainer's rank 0 and two rollout workers
    processes = [context.Process(target=_party, args=(rank, size, port, results, engine_dtype))
                 for rank in range(size)]
    for process in processes:
        process.start()
    outcome = sorted(results.get(timeout=120) for _ in range(size))
    for process in processes:
        process.join(timeout=30)
    assert [rank for rank, _, _ in outcome] == [0, 1, 2]
    assert all(buckets > 1 for _, buckets, _ in outcome), "the test should span several buckets"
    assert all(exact for _, _, exact in outcome), outcome


def _synced_weights(_index, model_dir: str, backend: str, out: str):
    """In a process of its own (a one-rank trainer group): weights a step away from the checkpoint's, not
    representable in bf16, as a checkpoint takes them and as the bf16 sync sends them, with the sync's metas."""
    from torch.distributed.tensor import DTensor

    from molt_train.actor.policy import PolicyRank
    from molt_train.config import ActorConfig, AlgoConfig, Config, EngineConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank = PolicyRank(model_dir, model_dir, 0, 1, f"tcp://127.0.0.1:{port}",
                      Config(algo=AlgoConfig(kl_coef=0.0), actor=ActorConfig(backend=backend), steps=1,
                             engine=EngineConfig(dtype="bfloat16")))
    try:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in rank.model.parameters():  # (one AutoModel rank leaves the model unsharded)
                local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
                local.add_(0.01 * torch.randn(local.shape, generator=generator))
        torch.save((rank.full_weights(), rank.full_weights(for_sync=True), rank.weight_meta()), out)
    finally:
        rank.close()


@pytest.mark.parametrize("kind,backend", [("dense", "fsdp2"), ("moe", "automodel")])
def test_an_engine_synced_in_bf16_holds_exactly_the_weights_of_the_fp32_sync(kind, backend, dense_dir, moe_dir,
                                                                           tmp_path):
    """A bf16 engine loads the trainer's fp32 weights cast to bf16 (the engine casts on load); the sync in
    bf16 casts first, on the trainer's side, and must leave the engine with the same bits. The MoE on
    AutoModel's own class sends per-expert tensors, which the engine puts into its fused ones."""
    from molt_agents.engines import make_engine

    model_dir = dense_dir if kind == "dense" else moe_dir
    mp.start_processes(_synced_weights, args=(str(model_dir), backend, str(tmp_path / "weights.pt")), nprocs=1,
                       start_method="spawn")
    fp32, bf16, metas = torch.load(tmp_path / "weights.pt", weights_only=False)
    assert {t.dtype for t in fp32.values()} == {torch.float32}  # checkpoints stay fp32
    assert {m.dtype for m in metas} == {"bfloat16"} and metas == tensor_meta(bf16.items())
    engines = [make_engine("hf", model_dir, dtype="bfloat16") for _ in range(3)]
    try:
        run(engines[0].update_weights(list(fp32.items())))
        run(engines[1].update_weights(list(bf16.items())))
        from_fp32, from_bf16, untouched = (engine.model.state_dict() for engine in engines)
    finally:
        for engine in engines:
            engine.close()
    assert from_fp32.keys() == from_bf16.keys()
    assert all(from_bf16[k].dtype == torch.bfloat16 and torch.equal(from_fp32[k], from_bf16[k]) for k in from_fp32)
    assert all(not torch.equal(from_fp32[k], untouched[k]) for k in from_fp32), \
        "the sync left a weight unchanged; the comparison would be vacuous"
