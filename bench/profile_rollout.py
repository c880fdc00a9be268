"""Profile one step's rollouts of the benchmark workload, in this process (no Ray, no trainer).

    .venv/bin/python bench/profile_rollout.py [--workload small] [--steps 10] [--cprofile [--sort cumulative]]
    .venv/bin/python bench/profile_rollout.py --env locker --model tiny:agent --max_tokens 32 \
        --agent environments.agents:LockerAgent      # an agent through the loopback

Builds Molt's `RolloutWorker` (the vLLM engine, the env runner) on the
workload's model and plays a step's 16 groups of 8 episodes at once, in one
`groups` call as the group stream submits them, `--steps` times (the median). Next to it, the
floor: the same 128 samples from `vllm.LLM.generate` in one call, prompts
tokenized beforehand. `--env`, `--agent` and `--max_tokens` time another
task, or an agent's episodes through the loopback, with the weights fixed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402


def molt_rollouts(model_dir: str, name: str, steps: int, profiler: bool, sort: str = "tottime", env: str | None = None,
                  agent: str | None = None, max_tokens: int | None = None) -> dict:
    from molt_agents.engines import SamplingParams
    from molt_train.config import EngineConfig, RolloutConfig
    from molt_train.model_fit import context_limit, model_config
    from molt_train.rollout import RolloutWorker

    sampling = SamplingParams(temperature=workload.TEMPERATURE,
                              max_tokens=max_tokens or workload.WORKLOADS[name]["max_tokens"], seed=0)
    worker = RolloutWorker(model_dir, env or str(Path(__file__).parent / "addition.py") + ":Addition",
                           RolloutConfig(max_total_tokens=1024),
                           EngineConfig(max_model_len=context_limit(model_config(model_dir))), sampling, agent=agent)

    async def one_step(step: int):
        return await worker.groups([(step * 16 + g, 1000 * step + g) for g in range(workload.GROUPS_PER_STEP)],
                                   workload.GROUP_SIZE)

    async def run():
        times = []
        for step in range(steps + 2):
            started = time.perf_counter()
            if profiler and step == steps + 1:
                return {"profile": await _profiled(one_step(step), sort)} | {"step": statistics.median(times)}
            await one_step(step)
            if step >= 2:
                times.append(time.perf_counter() - started)
        return {"step": statistics.median(times)}

    try:
        return asyncio.run(run())
    finally:
        worker.close()


async def _profiled(awaitable, sort: str) -> str:
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    await awaitable
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(sort).print_stats(40)
    return out.getvalue()


def floor_generate(model_dir: str, name: str, steps: int) -> dict:
    import os

    import numpy as np
    from transformers import AutoTokenizer

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams, TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model_dir, dtype="float32", seed=0)
    params = SamplingParams(n=workload.GROUP_SIZE, temperature=workload.TEMPERATURE,
                            max_tokens=workload.WORKLOADS[name]["max_tokens"], logprobs=0)
    times = []
    for step in range(steps + 2):
        prompts = []
        for g in range(workload.GROUPS_PER_STEP):
            a, b = workload.operands(np.random.default_rng(1000 * step + g))
            ids = tokenizer.apply_chat_template([{"role": "user", "content": workload.prompt(a, b)}],
                                                tokenize=True, add_generation_prompt=True, return_dict=False)
            prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if step >= 2:
            times.append(time.perf_counter() - started)
    return {"floor": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(workload.WORKLOADS), default="small")
    parser.add_argument("--model", help="the workload's model (default: build it in a temporary directory)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--sort", default="tottime", help="cProfile's order (tottime, cumulative, ...)")
    parser.add_argument("--floor", action="store_true", help="also time the floor (a second vLLM engine)")
    parser.add_argument("--env", help="another environment (default: the workload's)")
    parser.add_argument("--agent", help="a ChatAgent class that plays through the loopback (default: the env runner)")
    parser.add_argument("--max_tokens", type=int, help="tokens per turn (default: the workload's)")
    args = parser.parse_args()
    if args.model and args.model.startswith("tiny:"):
        from molt_agents.tiny.build import model_dir as tiny_model_dir
        args.model = str(tiny_model_dir(args.model))
    model_dir = args.model or str(workload.build(args.workload, tempfile.mkdtemp(prefix="molt-bench-")))
    result = molt_rollouts(model_dir, args.workload, args.steps, args.cprofile, args.sort, args.env, args.agent,
                           args.max_tokens)
    if "profile" in result:
        print(result.pop("profile"))
    if args.floor:
        result |= floor_generate(model_dir, args.workload, args.steps)
    for name, seconds in result.items():
        print(f"{name:>8}: {seconds * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
