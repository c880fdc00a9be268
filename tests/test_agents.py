"""The example agents, as a user's own OpenAI-client programs against the live loopback."""

import torch
from conftest import memorize, run
from transformers import AutoModelForCausalLM

from environments.agents import PythonToolAgent
from environments.python_tool import PYTHON_TOOL, PythonTool
from molt_agents.agent import run_agent
from molt_env.spaces import as_messages


def test_function_calling_agent_solves_python_tool_through_the_loopback(loopback, dense_dir):
    env = PythonTool()
    prompt, task = env.reset(seed=1)
    expression = prompt.split("? ")[0].removeprefix("What is ")
    call = ('<tool_call>\n{"name": "python", "arguments": {"code": "print(' + expression + ')"}}\n</tool_call>')
    conversation = as_messages(prompt) + [{"role": "assistant", "content": call},
                                          {"role": "tool", "content": f"{task['answer']}\n"},
                                          {"role": "assistant", "content": f"The answer is {task['answer']}."}]
    # The untrained tiny model writes noise; teach it this one exchange, load it through update_weights.
    run(loopback.engine.update_weights(list(memorize(dense_dir, [conversation], tools=[PYTHON_TOOL]).items())))
    try:
        (trajectory,) = run(run_agent(PythonToolAgent(), loopback, messages=as_messages(prompt),
                                      tools=[PYTHON_TOOL], sampling={"temperature": 0.0, "max_tokens": 64},
                                      task=task, rollout_id="r0", group_id="g0"))
    finally:
        original = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
        run(loopback.engine.update_weights(list(original.state_dict().items())))
    text = loopback.tokenizer.decode(trajectory.token_ids)
    assert trajectory.reward == 1.0, text
    # The agent's sandbox ran the call; its output came back as a tool turn inside the one trajectory.
    assert f"<tool_response>\n{task['answer']}\n" in text, text
    assert text.count("<|im_start|>assistant") == 2 and trajectory.num_trainable > 0
