"""The bucketed weight broadcast: the bucket plan, and the channel across real processes over gloo.

On GPU the same channel runs on NCCL; this machine has no GPU, so the
collective here is gloo (the end-to-end runs in test_train use it too).
"""

import torch
import torch.multiprocessing as mp

from molt_train.weight_sync import ALIGN, Bucket, Channel, TensorMeta, plan_buckets, tensor_meta


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


def _weights():
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(37, 8, generator=generator),
        "norm.weight": torch.randn(8, generator=generator).to(torch.bfloat16),
        "layers.0.proj.weight": torch.randn(8, 24, generator=generator),
        "step": torch.tensor([7, -3], dtype=torch.int64),
        "lm_head.weight": torch.randn(37, 8, generator=generator),
    }


def _party(rank, size, port, results):
    torch.set_num_threads(1)
    weights = _weights()
    buckets = plan_buckets(tensor_meta(weights.items()), bucket_bytes=1200)
    channel = Channel("127.0.0.1", port, rank, size, torch.device("cpu"), timeout=60)
    if rank == 0:
        for bucket in buckets:
            channel.send(bucket, weights)
        results.put((rank, len(buckets), True))
        return
    received = {name: tensor.clone() for name, tensor in channel.receive(buckets)}
    exact = list(received) == list(weights) and all(
        received[k].dtype == v.dtype and torch.equal(received[k], v) for k, v in weights.items())
    results.put((rank, len(buckets), exact))


def test_channel_broadcasts_every_bucket_exactly_to_every_receiver():
    from molt_train.weight_sync import free_endpoint

    _, port = free_endpoint()
    context = mp.get_context("spawn")
    results = context.Queue()
    size = 3  # the trainer's rank 0 and two rollout workers
    processes = [context.Process(target=_party, args=(rank, size, port, results)) for rank in range(size)]
    for process in processes:
        process.start()
    outcome = sorted(results.get(timeout=120) for _ in range(size))
    for process in processes:
        process.join(timeout=30)
    assert [rank for rank, _, _ in outcome] == [0, 1, 2]
    assert all(buckets > 1 for _, buckets, _ in outcome), "the test should span several buckets"
    assert all(exact for _, _, exact in outcome), outcome
