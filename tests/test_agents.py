"""The example agents, as a user's own programs on the stock `openai`, OpenAI Agents SDK and `anthropic` clients,
against the live loopback; and `molt-train --agent` training them end to end."""

import pytest
import torch
from conftest import memorize, run
from test_loopback import _max_trained_logprob_error
from test_train import _train
from transformers import AutoModelForCausalLM

from environments.agents import (
    AgentsSDKChat,
    AgentsSDKPythonTool,
    AnthropicPythonTool,
    PythonToolAgent,
)
from environments.digit import Digit
from environments.python_tool import PYTHON_TOOL, PythonTool
from molt_agents.agent import run_agent
from molt_env.spaces import as_messages
from molt_env.trajectory import check


def _teach(loopback, dense_dir, conversation, tools=None):
    """The untrained tiny model writes noise: teach it one exchange, load it through update_weights.
    Returns the taught model (for an independent recompute of the logprobs)."""
    state = memorize(dense_dir, [conversation], tools=tools)
    run(loopback.engine.update_weights(list(state.items())))
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    model.load_state_dict(state)
    return model


@pytest.fixture
def restore_weights(loopback, dense_dir):
    yield
    original = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    run(loopback.engine.update_weights(list(original.state_dict().items())))


def test_agents_sdk_agent_is_captured_token_exact(loopback, dense_dir, restore_weights):
    env = Digit()
    prompt, task = env.reset(seed=1)
    model = _teach(loopback, dense_dir, as_messages(prompt) + [{"role": "assistant", "content": task["digit"]}])
    for max_tokens, reward in ((8, 1.0), (1, 0.0)):  # 1 token: the digit, cut before its end of turn
        (trajectory,) = run(run_agent(AgentsSDKChat(), loopback, messages=as_messages(prompt), env=env,
                                      sampling={"temperature": 0.0, "max_tokens": max_tokens}, task=task))
        check(trajectory)
        # A reply cut at max_output_tokens is an `incomplete` response, which the SDK raises on: reward 0,
        # and its tokens are still trained.
        assert trajectory.reward == reward and trajectory.finish_reason == ("stop" if reward else "length")
        assert loopback.tokenizer.decode(trajectory.token_ids).endswith(f"assistant\n{task['digit']}" +
                                                                        "<|im_end|>" * (max_tokens > 1))
        error = _max_trained_logprob_error(model, trajectory)
        print(f"AgentsSDKChat (max_tokens {max_tokens}): max |engine - transformers| logprob over "
              f"{trajectory.num_trainable} sampled tokens = {error:.2e}")
        assert error < 1e-5


def test_tool_agents_on_three_sdks_leave_one_trajectory(loopback, dense_dir, restore_weights):
    """The same `python_tool` episode played with Chat Completions, the Agents SDK (Responses) and the
    Messages API: the sandbox's output comes back as a tool turn inside one trajectory, token for token
    the same whichever SDK the agent is written on."""
    env = PythonTool()
    prompt, task = env.reset(seed=1)
    expression = prompt.split("? ")[0].removeprefix("What is ")
    call = ('<tool_call>\n{"name": "python", "arguments": {"code": "print(' + expression + ')"}}\n</tool_call>')
    model = _teach(loopback, dense_dir, as_messages(prompt) + [
        {"role": "assistant", "content": call}, {"role": "tool", "content": f"{task['answer']}\n"},
        {"role": "assistant", "content": f"The answer is {task['answer']}."}], tools=[PYTHON_TOOL])
    trajectories = []
    for agent in (PythonToolAgent(), AgentsSDKPythonTool(), AnthropicPythonTool()):
        conversation = []
        (trajectory,) = run(run_agent(agent, loopback, messages=as_messages(prompt), tools=[PYTHON_TOOL],
                                      sampling={"temperature": 0.0, "max_tokens": 64}, task=task, env=env,
                                      conversation=conversation))
        check(trajectory)
        # the last chat request and its reply, whatever the wire (what a reward model reads)
        assert [m["role"] for m in conversation][-3:] == ["assistant", "tool", "assistant"], conversation
        assert conversation[-1]["content"] == f"The answer is {task['answer']}."
        assert any(m["role"] == "user" and expression in str(m["content"]) for m in conversation)
        text = loopback.tokenizer.decode(trajectory.token_ids)
        assert trajectory.reward == 1.0, (type(agent).__name__, text)
        assert f"<tool_response>\n{task['answer']}\n" in text, text
        assert text.count("<|im_start|>assistant") == 2
        error = _max_trained_logprob_error(model, trajectory)
        print(f"{type(agent).__name__}: {len(trajectory.token_ids)} tokens, max |engine - transformers| logprob "
              f"over {trajectory.num_trainable} sampled = {error:.2e}")
        assert error < 1e-5
        trajectories.append(trajectory)
    first = trajectories[0]
    for trajectory in trajectories[1:]:
        assert trajectory.token_ids == first.token_ids and trajectory.mask == first.mask
        assert trajectory.logprobs == pytest.approx(first.logprobs, abs=1e-6)


@pytest.mark.parametrize("agent,env", [("AgentsSDKChat", "digit"), ("AnthropicPythonTool", "python_tool")])
def test_molt_train_trains_an_sdk_agent(tmp_path, ray_address, agent, env):
    rows = _train(tmp_path / agent, ray_address, "--agent", f"environments.agents:{agent}", "--env", env,
                  "--steps", "3", "--rollout.groups_per_step", "2", "--rollout.group_size", "4",
                  "--train.async_queue_size", "0")
    print(f"{agent} on {env}: mismatch/max_abs per step {[r['mismatch/max_abs'] for r in rows]}, "
          f"mismatch/kl {[r['mismatch/kl'] for r in rows]}, reward {[r['reward/mean'] for r in rows]}")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["episodes/failed"] == 0 and r["tokens/trained"] > 0 for r in rows)
    assert all(r["mismatch/max_abs"] < 1e-4 for r in rows)  # the SDK's requests were captured token-exact
