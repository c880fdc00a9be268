"""The transformers fallback engine: same contract as vLLM, plus MoE expert routes on CPU."""

import numpy as np
import pytest
import torch
from conftest import run
from test_engine_vllm import _check_against_transformers, _check_samples, _prompt
from transformers import AutoModelForCausalLM

from molt_agents.engines import SamplingParams, make_engine
from molt_agents.engines.hf_engine import sample_token


@pytest.fixture(scope="module", params=["loop", "thread"])
def hf_moe(moe_dir, request):
    """The engine stepping on the event loop (as CPU engines do) and on a thread of its own (as GPU ones do)."""
    engine = make_engine("hf", moe_dir, stepping=request.param)
    assert engine.stepping == request.param
    yield engine
    engine.close()


def test_hf_engine_batches_and_matches_transformers(hf_moe, moe_dir):
    prompt = _prompt(moe_dir)
    params = SamplingParams(max_tokens=12, n=3, seed=4, top_logprobs=2)

    async def both():  # two prompts of different lengths in flight together: one padded batch
        import asyncio

        return await asyncio.gather(hf_moe.generate(prompt, params), hf_moe.generate(prompt[:-3], params))

    samples, shorter = run(both())
    _check_samples(samples, params, version=hf_moe.version)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    assert _check_against_transformers(model, prompt, samples) < 1e-5
    assert _check_against_transformers(model, prompt[:-3], shorter) < 1e-5
    assert all(len(top) == 2 for top in samples[0].top_logprobs)


def test_hf_engine_captures_routes_that_replay_the_forward(hf_moe, moe_dir):
    prompt = _prompt(moe_dir)
    (sample,) = run(hf_moe.generate(prompt, SamplingParams(max_tokens=8, seed=0)))
    routes = sample.routes
    config = AutoModelForCausalLM.from_pretrained(moe_dir).config
    total = len(prompt) + len(sample.token_ids)
    assert routes.dtype == np.int16 and routes.shape == (total, config.num_hidden_layers, config.num_experts_per_tok)
    assert (routes[-1] == -1).all() and (routes[:-1] >= 0).all()
    # The recorded experts are the ones an unpadded forward over the same tokens picks.
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    chosen = []
    hooks = [m.register_forward_hook(lambda mod, a, out: chosen.append(out[-1]))
             for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    with torch.no_grad():
        model(torch.tensor([prompt + sample.token_ids[:-1]]))
    for hook in hooks:
        hook.remove()
    reference = torch.stack(chosen, 1).numpy()  # [T-1, layers, top_k]
    assert np.array_equal(np.sort(routes[:-1], -1), np.sort(reference, -1))


def test_hf_engine_weight_update_and_pause(hf_moe, moe_dir):
    import asyncio

    prompt = _prompt(moe_dir)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)

    async def scenario():
        await hf_moe.pause()
        request = asyncio.ensure_future(hf_moe.generate(prompt, SamplingParams(max_tokens=6, seed=1)))
        await asyncio.sleep(0.2)
        assert not request.done()  # paused: no step runs
        version = await hf_moe.update_weights(list(model.state_dict().items()))
        await hf_moe.resume()
        return version, await request

    version, (sample,) = run(scenario())
    assert set(sample.versions) == {version}  # every token sampled after the swap
    assert _check_against_transformers(model, prompt, [sample]) < 1e-5
    original = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    run(hf_moe.update_weights(list(original.state_dict().items())))


def test_hf_engine_loads_weights_named_as_in_the_checkpoint(hf_moe, moe_dir, tmp_path):
    """A trainer other than transformers (NeMo AutoModel's own MoE classes) sends the checkpoint's
    per-expert tensors; transformers keeps each layer's experts fused. The engine puts them in place."""
    import shutil

    from safetensors.torch import load_file, save_file

    checkpoint = load_file(moe_dir / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    assert "model.layers.0.mlp.experts.1.up_proj.weight" not in model.state_dict()  # fused in memory
    generator = torch.Generator().manual_seed(0)
    changed = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
               for name, tensor in checkpoint.items() if ".experts." in name}
    prompt = _prompt(moe_dir)
    try:
        run(hf_moe.update_weights(list(changed.items())))
        (sample,) = run(hf_moe.generate(prompt, SamplingParams(max_tokens=6, seed=2)))
        shutil.copytree(moe_dir, tmp_path / "changed")  # the same tensors, loaded by transformers
        save_file({**checkpoint, **changed}, tmp_path / "changed" / "model.safetensors")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "changed", dtype=torch.float32)
        assert _check_against_transformers(model, prompt, [sample]) < 1e-5
        original = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
        assert _check_against_transformers(original, prompt, [sample]) > 1e-3  # the experts did change
        with pytest.raises(KeyError, match="neither in"):
            run(hf_moe.update_weights([("model.layers.0.mlp.experts.9.up_proj.weight", torch.zeros(1))]))
    finally:
        original = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
        run(hf_moe.update_weights(list(original.state_dict().items())))


def test_sample_token_truncations():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        token, logprob, _ = sample_token(logits, SamplingParams(top_k=2), generator)
        assert token in (0, 1)
        assert logprob == pytest.approx(torch.log_softmax(logits[:2], -1)[token].item(), abs=1e-6)
    token, logprob, top = sample_token(logits, SamplingParams(temperature=0), None, top_logprobs=3)
    assert token == 0 and list(top) == [0, 1, 2]
    # top_p=0.5: the first token alone holds 0.66 of the mass.
    assert all(sample_token(logits, SamplingParams(top_p=0.5), generator)[0] == 0 for _ in range(10))


def test_engine_survives_a_caller_whose_event_loop_closed(hf_moe, moe_dir):
    """A caller that vanishes mid-request (a server shut down) must not take the engine thread with it."""
    import asyncio
    import time

    prompt = _prompt(moe_dir)
    loop = asyncio.new_event_loop()
    loop.create_task(hf_moe.generate(prompt, SamplingParams(max_tokens=50, seed=0)))
    loop.run_until_complete(asyncio.sleep(0.1))  # submitted and generating
    loop.close()  # gone, without cancelling
    time.sleep(0.5)
    (sample,) = run(asyncio.wait_for(hf_moe.generate(prompt, SamplingParams(max_tokens=3, seed=1)), 60))
    assert 1 <= len(sample.token_ids) <= 3


def test_requests_from_two_event_loops_at_once_and_a_loop_that_ends_first(hf_moe, moe_dir):
    """Callers on two threads' loops share the engine: both get their samples, exact and stamped; when the
    loop that was stepping ends, the other loop's request still finishes (the stepping moves to it)."""
    import asyncio
    import threading

    prompt = _prompt(moe_dir)
    results = {}

    def other_thread():
        results["other"] = asyncio.run(hf_moe.generate(prompt, SamplingParams(max_tokens=40, seed=7)))

    async def here():
        first = asyncio.ensure_future(hf_moe.generate(prompt, SamplingParams(max_tokens=2, seed=6)))
        await asyncio.sleep(0)  # this loop asks first
        thread.start()
        return await first  # then this loop ends while the other thread's request is still sampling

    thread = threading.Thread(target=other_thread)
    (mine,) = run(here())
    thread.join(timeout=120)
    assert not thread.is_alive(), "the other loop's request never finished"
    (theirs,) = results["other"]
    assert len(mine.token_ids) <= 2 and 1 <= len(theirs.token_ids) <= 40
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    assert _check_against_transformers(model, prompt, [mine, theirs]) < 1e-5
    assert set(mine.versions) == set(theirs.versions) == {hf_moe.version}


def test_multi_turn_episode_carries_the_routes_of_every_position(hf_moe, moe_dir):
    """Routes through the env runner: each turn's prefill fills the positions it sees first."""
    from test_env import Chatty
    from transformers import AutoTokenizer

    from molt_agents.runner import run_episode
    from molt_env import check

    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    (trajectory,) = run(run_episode(Chatty(), hf_moe, tokenizer, SamplingParams(max_tokens=6, seed=0),
                                    max_total_tokens=1024, seed=0))
    check(trajectory)  # includes routes [T, layers, top_k] int16
    routes = trajectory.routes
    last_sampled = max(i for i, m in enumerate(trajectory.mask) if m)
    assert (routes[:last_sampled] >= 0).all()  # every position fed to the engine has its experts
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    chosen = []
    hooks = [m.register_forward_hook(lambda mod, a, out: chosen.append(out[-1]))
             for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    with torch.no_grad():
        model(torch.tensor([trajectory.token_ids[:last_sampled]]))
    for hook in hooks:
        hook.remove()
    reference = torch.stack(chosen, 1).numpy()
    assert np.array_equal(np.sort(routes[:last_sampled], -1), np.sort(reference, -1))
