"""The bucketed weight sync over NCCL, with partial rollout, from a trainer process to the engine.

The CPU version (tests/test_weight_sync.py, and test_train's runs) uses gloo.
Here the trainer is a process of its own that sends a changed policy bucket by
bucket on the real `Channel` (NCCL); this process is the rollout side: its vLLM
engine pauses with a request in flight, loads every bucket as it arrives (the
same `channel.receive` → `engine.update_weights` path as `RolloutWorker`),
and resumes. The request in flight must carry both versions, and a new request
must sample from the new weights exactly (fp32, 1e-4).

NCCL refuses two ranks of one group on the same GPU ("Duplicate GPU
detected"), so this needs two GPUs: the engine on cuda:0, the trainer on cuda:1.
On a one-GPU machine `molt-train` must therefore sync by the object store
(test_train_bf16 does so).
"""

import pytest
import torch
import torch.multiprocessing as mp
from conftest import long_request, run  # tests/conftest.py

from molt_agents.engines import SamplingParams

from .conftest import CUDA, GPU_ENGINE_ARGS, needs

pytestmark = [
    pytest.mark.skipif(not CUDA, reason="no CUDA: NCCL weight sync check"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                       reason="one GPU: NCCL refuses two ranks on one device (Duplicate GPU detected); "
                              "the NCCL weight sync needs 2 GPUs"),
    needs("vllm"),
]

BUCKET_BYTES = 1 << 16  # 64 KiB: the tiny model crosses in several buckets


def _changed_policy(model_dir):
    """A visibly different policy: what an optimizer step would send."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(2.0)
        model.lm_head.weight.mul_(1.5)
    return model


def _trainer(model_dir, port, results):
    """Channel rank 0 on cuda:1: plan the buckets from the tensor list and broadcast each."""
    from molt_train.weight_sync import Channel, plan_buckets, tensor_meta

    torch.cuda.set_device(1)
    weights = _changed_policy(model_dir).state_dict()
    buckets = plan_buckets(tensor_meta(weights.items()), BUCKET_BYTES)
    channel = Channel("127.0.0.1", port, 0, 2, torch.device("cuda", 1), timeout=120)
    for bucket in buckets:
        channel.send(bucket, weights)
    torch.cuda.synchronize()
    results.put(len(buckets))


def test_nccl_bucketed_sync_with_partial_rollout(vllm_engines, dense_dir, record_property):
    import asyncio
    import time

    from molt_train.weight_sync import Channel, free_endpoint, plan_buckets, tensor_meta

    engine = vllm_engines.get(dense_dir, dtype="float32", **GPU_ENGINE_ARGS)
    new = _changed_policy(dense_dir)
    buckets = plan_buckets(tensor_meta(new.state_dict().items()), BUCKET_BYTES)
    assert len(buckets) > 1, "the check should span several buckets"
    _, port = free_endpoint()
    context = mp.get_context("spawn")
    results = context.Queue()
    trainer = context.Process(target=_trainer, args=(dense_dir, port, results))
    trainer.start()
    prompt = list(range(5, 200))  # max_model_len 4096 leaves room for the long request

    async def scenario():
        # Join the channel first (the trainer process takes seconds to start), then start a long request.
        channel = await asyncio.to_thread(Channel, "127.0.0.1", port, 1, 2, torch.device("cuda", 0), 120)
        old = await long_request(engine, prompt, 1000)
        await engine.pause()
        began = time.perf_counter()
        try:
            version = await engine.update_weights(channel.receive(buckets))
        finally:
            await engine.resume()
        seconds = time.perf_counter() - began
        fresh = await engine.generate(prompt, SamplingParams(max_tokens=16, seed=2))
        return (await old)[0], fresh, version, seconds

    try:
        old, fresh, version, seconds = run(scenario())
        assert results.get(timeout=60) == len(buckets)
        trainer.join(timeout=30)
        assert set(old.versions) == {version - 1, version}, "the request in flight should span the sync"
        ids = torch.tensor([prompt + fresh[0].token_ids], device="cuda")
        model = new.cuda()
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1: -1].float()
        reference = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()
        worst = (reference - torch.tensor(fresh[0].logprobs)).abs().max().item()
        record_property("buckets", len(buckets))
        record_property("sync_seconds", seconds)
        record_property("max_abs_logprob_delta_after_sync", worst)
        print(f"NCCL sync: {len(buckets)} buckets in {seconds:.3f} s; request in flight spans versions "
              f"{sorted(set(old.versions))}; new weights' logprobs within {worst:.2e}")
        assert worst < 1e-4
    finally:
        if trainer.is_alive():
            trainer.kill()
        from transformers import AutoModelForCausalLM

        original = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
        run(engine.update_weights(list(original.state_dict().items())))
