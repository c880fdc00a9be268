"""The dry run's memory plan against trainer steps on CUDA, up to a Qwen3-0.6B-shaped model.

On CPU (tests/test_plan.py) the estimate is checked against the CPU
allocator's own accounting; the GPU kernels (SDPA's attention on CUDA, the
fused AdamW, NCCL's buffers) hold what the CPU ones do not, which the
estimate assumes (docs/scaling.md, "Dry run"). Here the real `PolicyRank`
(one rank in this process, no Ray) steps twice, and the second step's
`torch.cuda.max_memory_allocated` is compared with the plan of the same flags
as `molt-train`'s own parser reads them; the bound is wider than on CPU until
a GPU run has measured it. `molt-train --dry-run` with those flags, for one
GPU of 80 GB (the smaller lent machine's), must say that the run fits.

The cases: the tiny dense model in fp32, and in bf16 with full activation
checkpointing; and a model of Qwen3-0.6B's shape (`molt-tiny --like
recipes/models/qwen3-0.6b`: 596M parameters, random weights) in bf16 with
full checkpointing and logprobs in chunks of 1024 positions, on micro-batches
of four 1024-token episodes (rows as wide as an episode, the plan's worst
case), whose step time goes into the report too.
"""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from .conftest import CUDA, needs, on_device

pytestmark = pytest.mark.skipif(not CUDA, reason="no CUDA: memory model on CUDA check")

BOUND = 0.30
ROOT = Path(__file__).resolve().parents[2]
BF16_FULL = ["--actor.param_dtype", "bfloat16", "--actor.activation_checkpointing", "full"]
# (model: "tiny" or a recipes/models folder, flags, tokens per episode, of which the prompt)
CASES = {
    "tiny-fp32": ("tiny", ["--train.micro_batch_tokens", "2048", "--rollout.max_total_tokens", "512"], 128, 64),
    "tiny-bf16-full": ("tiny", ["--train.micro_batch_tokens", "2048", "--rollout.max_total_tokens", "512",
                                *BF16_FULL], 128, 64),
    "qwen3-0.6b-bf16-full-chunked": ("qwen3-0.6b", ["--train.micro_batch_tokens", "4096", "--rollout.max_total_tokens",
                                                    "1024", *BF16_FULL, "--actor.logprob_chunk_tokens", "1024"],
                                     1024, 64),
}
# One GPU of 80 GB beside 128 GB of host memory; one GPU holds the trainer and the engine (colocated).
ONE_GPU = ["--cluster.nodes", "1", "--cluster.gpus_per_node", "1", "--cluster.gpu_memory_gb", "80",
           "--cluster.cpu_memory_gb", "128", "--actor.colocate", "--train.async_queue_size", "0",
           "--train.weight_sync", "object_store"]


def _model(name: str) -> Path:
    from molt_agents.tiny import tiny_model
    from molt_agents.tiny.build import shaped_model

    return tiny_model("dense") if name == "tiny" else shaped_model(ROOT / "recipes" / "models" / name)


@pytest.mark.parametrize("case", CASES)
def test_the_trainer_estimate_matches_the_cuda_peak(case, record_property):
    from molt_train.actor.policy import PolicyRank
    from molt_train.cli import parse_config
    from molt_train.packing import TrainItem, pack
    from molt_train.plan.memory import trainer_memory
    from molt_train.plan.shape import shape

    name, flags, length, prompt = CASES[case]
    model_dir = _model(name)
    model = json.loads((model_dir / "config.json").read_text())
    dry_run = subprocess.run([sys.executable, "-m", "molt_train.cli", "--model", str(model_dir), "--dry-run",
                              *flags, *ONE_GPU], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert dry_run.returncode == 0 and "the run fits" in dry_run.stdout, dry_run.stdout + dry_run.stderr
    config, _ = parse_config([*flags, "--steps", "2"])
    estimate = trainer_memory(shape(model), config)
    budget = config.train.micro_batch_tokens
    generator, items = np.random.default_rng(0), []
    for _ in range(2 * budget // length):  # two micro-batches
        mask = [0] * prompt + [1] * (length - prompt)
        items.append(TrainItem(token_ids=generator.integers(3, model["vocab_size"], length).tolist(), mask=mask,
                               logprobs=[-1.0 if m else None for m in mask], ages=[0] * length, advantage=1.0))
    batches = [on_device(mb, "cuda") for mb in pack(items, budget)]  # the first CUDA call
    tokens = int(sum(mb.mask.sum() for mb in batches))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = PolicyRank(str(model_dir), str(model_dir), 0, 1, f"tcp://127.0.0.1:{port}", config)
    try:
        policy.step(batches, tokens)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        stats = policy.step(batches, tokens)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        measured = torch.cuda.max_memory_allocated()
    finally:
        policy.close()
    ratio = estimate.total / measured
    record_property("estimated_gib", round(estimate.total / 2**30, 3))
    record_property("measured_gib", round(measured / 2**30, 3))
    record_property("estimate_over_measured", round(ratio, 3))
    record_property("step_seconds", round(seconds, 3))
    record_property("tokens_per_second", round(sum(mb.num_tokens for mb in batches) / seconds))
    print(f"{case}: {policy.describe()}; plan {estimate.total / 2**30:.2f} GiB, max_memory_allocated "
          f"{measured / 2**30:.2f} GiB (ratio {ratio:.3f}); step {seconds:.2f} s, loss {stats.loss_sum / tokens:.4f}")
    assert np.isfinite(stats.loss_sum)
    assert abs(ratio - 1) <= BOUND


def _model_memory(worker) -> int:
    return worker.model_runner.model_memory_usage  # vLLM's own count of the weights it loaded on the GPU


@needs("vllm")
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
