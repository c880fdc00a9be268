"""The dry-run's memory model against a trainer step on CUDA.

On CPU (tests/test_plan.py) the estimate is checked against the CPU
allocator's own accounting; the GPU kernels (SDPA's attention on CUDA, the
foreach AdamW, NCCL's buffers) hold what the CPU ones do not, which the
estimate assumes (docs/scaling.md, "Dry run"). Here the real `PolicyRank`
steps twice on the tiny dense model and the second step's
`torch.cuda.max_memory_allocated` is compared with the estimate of the same
flags; the numbers go into the report, and the bound is wider than on CPU
until a GPU run has measured it.
"""

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from .conftest import on_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: memory model on CUDA check")

BOUND = 0.30


@pytest.mark.parametrize("actor", [{}, {"param_dtype": "bfloat16", "activation_checkpointing": "full"}],
                         ids=["fp32", "bf16-full"])
def test_the_trainer_estimate_matches_the_cuda_peak(actor, dense_dir, record_property):
    from molt_train.actor.policy import PolicyRank
    from molt_train.config import ActorConfig, AlgoConfig, Config, RolloutConfig, TrainConfig
    from molt_train.packing import TrainItem, pack
    from molt_train.plan.memory import trainer_memory
    from molt_train.plan.shape import shape

    config = Config(actor=ActorConfig(**actor), algo=AlgoConfig(kl_coef=0.1),
                    train=TrainConfig(micro_batch_tokens=2048), rollout=RolloutConfig(max_total_tokens=512), steps=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = PolicyRank(str(dense_dir), str(dense_dir), 0, 1, f"tcp://127.0.0.1:{port}", config)
    try:
        generator, items = np.random.default_rng(0), []
        for _ in range(2 * 2048 // 128):
            mask = [0] * 64 + [1] * 64
            items.append(TrainItem(token_ids=generator.integers(3, 1024, 128).tolist(), mask=mask,
                                   logprobs=[-1.0 if m else None for m in mask], ages=[0] * 128, advantage=1.0))
        batches = [on_device(mb, "cuda") for mb in pack(items, 2048)]
        tokens = int(sum(mb.mask.sum() for mb in batches))
        policy.step(batches, tokens)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        policy.step(batches, tokens)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
    finally:
        policy.close()
    estimate = trainer_memory(shape(json.loads((Path(dense_dir) / "config.json").read_text())), config)
    ratio = estimate.total / measured
    record_property("estimated_mib", round(estimate.total / 2**20, 2))
    record_property("measured_mib", round(measured / 2**20, 2))
    record_property("estimate_over_measured", round(ratio, 3))
    assert abs(ratio - 1) <= BOUND


def _model_memory(worker) -> int:
    return worker.model_runner.model_memory_usage  # vLLM's own count of the weights it loaded on the GPU


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_engine_weight_estimate_matches_vllm_s_loaded_weights(kind, vllm_engines, request, record_property):
    from molt_train.config import Config, EngineConfig
    from molt_train.plan.memory import engine_memory
    from molt_train.plan.shape import shape

    from .conftest import GPU_ENGINE_ARGS

    model_dir = request.getfixturevalue(f"{kind}_dir")
    engine = vllm_engines.get(model_dir, dtype="bfloat16", **GPU_ENGINE_ARGS)
    measured = engine._engine.collective_rpc(_model_memory)[0]
    config = Config(engine=EngineConfig(dtype="bfloat16"))
    estimate = engine_memory(shape(json.loads((Path(model_dir) / "config.json").read_text())), config, 141).weights
    ratio = estimate / measured
    record_property("estimated_mib", round(estimate / 2**20, 3))
    record_property("measured_mib", round(measured / 2**20, 3))
    record_property("estimate_over_measured", round(ratio, 3))
    assert abs(ratio - 1) <= BOUND
