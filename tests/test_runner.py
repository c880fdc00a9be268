"""The env runner on the real vLLM engine: multi-turn episodes stitched token-exact."""

import torch
from conftest import run
from test_env import Chatty
from test_loopback import _max_trained_logprob_error
from transformers import AutoModelForCausalLM, AutoTokenizer

import environments.arithmetic
from molt_agents.chat_template import render_text
from molt_agents.engines import SamplingParams
from molt_agents.segment import Segment
from molt_agents.runner import run_episode
from molt_env import check


def test_multi_turn_episode_is_one_segment_with_exact_tokens(vllm_dense, dense_dir):
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    params = SamplingParams(max_tokens=12, seed=0)
    (trajectory,) = run(run_episode(Chatty(), vllm_dense, tokenizer, params, max_total_tokens=1024,
                                    seed=0, group_id="g"))
    check(trajectory)
    assert trajectory.info["step_rewards"] == [0.5, 0.5, 0.5] and trajectory.reward == 1.5
    assert not trajectory.truncated
    # Three replies, each a run of sampled tokens, separated by context (env turns).
    runs = sum(1 for i, m in enumerate(trajectory.mask) if m and (i == 0 or not trajectory.mask[i - 1]))
    assert runs == 3
    text = tokenizer.decode(trajectory.token_ids)
    assert "turn 1" in text and "turn 2" in text and "# Tools" in text
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    assert _max_trained_logprob_error(model, trajectory) < 1e-4


def test_turn_and_token_budgets_truncate(vllm_dense, dense_dir):
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    env = Chatty()
    env.max_turns = 2
    (trajectory,) = run(run_episode(env, vllm_dense, tokenizer, SamplingParams(max_tokens=8, seed=1),
                                    max_total_tokens=1024))
    assert trajectory.truncated and trajectory.info["turns"] == 2

    prompt = Segment.from_text(tokenizer, render_text(tokenizer, Chatty().reset(seed=0)[0], Chatty.tools))
    budget = len(prompt.token_ids) + 20
    (short,) = run(run_episode(Chatty(), vllm_dense, tokenizer, SamplingParams(max_tokens=64, seed=1),
                               max_total_tokens=budget))
    assert short.truncated and short.num_trainable <= 20
    assert short.info["turns"] < 3


def test_single_turn_arithmetic_episode(vllm_dense, dense_dir):
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    (trajectory,) = run(run_episode(environments.arithmetic.Arithmetic(), vllm_dense, tokenizer,
                                    SamplingParams(max_tokens=8, seed=2), max_total_tokens=256, seed=4))
    check(trajectory)
    assert trajectory.info["turns"] == 1 and trajectory.reward in (0.0, 1.0)
    assert trajectory.info["reset_info"]["answer"] == environments.arithmetic.Arithmetic().reset(seed=4)[1]["answer"]


def test_renders_are_remembered_unless_the_template_reads_the_clock(dense_dir):
    import copy

    from molt_agents.chat_template import _renders

    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    messages = [{"role": "user", "content": "3+4="}]
    first = render_text(tokenizer, messages)
    assert render_text(tokenizer, messages) == first == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert list(_renders(tokenizer).values()) == [first]
    assert render_text(tokenizer, messages, add_generation_prompt=False) != first  # part of the key
    clock = copy.deepcopy(tokenizer)
    clock.chat_template = "{{ strftime_now('%H:%M:%S.%f') }}" + tokenizer.chat_template
    assert _renders(clock) is None and render_text(clock, messages).endswith(first)
