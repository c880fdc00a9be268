"""The bundled environments: registered, check_env-clean, rewards right on hand-written replies."""

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import environments  # noqa: F401
import molt_env
from environments.countdown import extract_expression, score
from environments.digit import Digit
from environments.frozen_lake import parse_move
from environments.guess_number import GuessNumber
from environments.python_tool import PythonTool, final_answer

NAMES = ["digit", "arithmetic", "countdown", "guess_number", "guess_number_told", "frozen_lake", "python_tool", "locker",
         "shapes"]


@pytest.mark.parametrize("name", NAMES)
def test_registered_and_check_env_clean(name):
    env = molt_env.make(name)
    check_env(env, skip_render_check=True)
    assert isinstance(gymnasium.make(molt_env.registered()[name]).unwrapped, type(env))


def test_digit_reward():
    env = Digit()
    _, info = env.reset(seed=3)
    digit = info["digit"]
    assert env.step(f" {digit}")[1] == 1.0
    assert env.step(f"{(int(digit) + 1) % 10}{digit}")[1] == 0.0
    assert env.step("")[1] == 0.0


@pytest.mark.parametrize("reply,expected", [
    ("Answer: (5 + 6) - 8", 1.0),        # 3
    ("I try 5 * 6.\nAnswer: 8 - 5", 1.0),  # 3, after Answer:
    ("Answer: 5 + 5 - 7", 0.0),          # 5 used twice, 7 not given
    ("Answer: 6 / (8 - 8)", 0.0),        # division by zero
    ("Answer: __import__('os')", 0.0),   # not arithmetic
    ("no idea", 0.0),
    ("Answer: 6 - 5 + 8 - 8", 0.0),      # 8 used twice
])
def test_countdown_reward(reply, expected):
    assert score(reply, [5, 6, 8], 3) == expected


def test_countdown_extracts_the_committed_expression():
    assert extract_expression("think 1+1\nAnswer: 2 * 3 = 6") == "2 * 3"
    assert extract_expression("words only") is None


def test_guess_number_rewards_fewer_turns_and_truncates():
    env = GuessNumber(low=1, high=20, max_turns=3)
    _, info = env.reset(seed=0)
    secret = info["secret"]
    assert env.step(str(secret)) == ("", 1.0, True, False, {"turns": 1})
    env.reset(seed=0)
    wrong = secret + 1 if secret < 20 else secret - 1
    hint, reward, terminated, truncated, _ = env.step(str(wrong))
    assert hint in ("higher", "lower") and (hint == "higher") == (wrong < secret)
    assert env.step(str(secret))[1] == pytest.approx(0.9)
    env.reset(seed=0)
    outcomes = [env.step("none")[:4] for _ in range(3)]
    assert outcomes[-1][1:] == (0.0, False, True)  # truncated at the turn budget


def test_frozen_lake_adapter():
    assert parse_move("I will go Down.") == 1 and parse_move("right then up") == 3 and parse_move("hmm") is None
    env = molt_env.make("frozen_lake")
    env.reset(seed=0)
    rewards = [env.step(move)[1] for move in ["right", "right", "down", "down", "down"]]
    observation, reward, terminated, _, _ = env.step("right")
    assert rewards == [0.0] * 5 and reward == 1.0 and terminated
    env.reset(seed=0)
    assert env.step("dance")[0].startswith("That is not a move")


def _call(code: str) -> str:
    import json

    return '<tool_call>\n' + json.dumps({"name": "python", "arguments": {"code": code}}) + '\n</tool_call>'


def test_python_tool_runs_calls_in_the_sandbox_and_grades_the_final_answer():
    env = PythonTool(max_turns=4)
    prompt, info = env.reset(seed=3)
    assert "python tool" in prompt and env.tools[0]["function"]["name"] == "python"
    observation, reward, terminated, truncated, _ = env.step("Let me compute.\n" + _call(
        prompt.split("? ")[0].removeprefix("What is ").join(["print(", ")"])))
    assert [m["role"] for m in observation] == ["tool"] and observation[0]["content"].strip() == str(info["answer"])
    assert (reward, terminated, truncated) == (0.0, False, False)
    _, reward, terminated, _, step_info = env.step(f"The answer is {info['answer']}.")
    assert (reward, terminated) == (1.0, True) and step_info == {"turns": 2, "tool_calls": 1, "tool_errors": 0}

    env.reset(seed=3)
    assert env.step(f"It is {info['answer'] + 1}")[1:3] == (0.0, True)


def test_python_tool_reports_bad_calls_and_hostile_code_as_tool_errors_and_goes_on():
    env = PythonTool(max_turns=4)
    env.reset(seed=0)
    bad_json = '<tool_call>\n{"name": "python", "arguments": "{not json"}\n</tool_call>'
    observation, _, terminated, _, _ = env.step(bad_json)
    assert observation[0]["content"].startswith("[error] arguments are not JSON") and not terminated
    observation, _, terminated, _, _ = env.step('<tool_call>\n{"name": "shell", "arguments": {}}\n</tool_call>')
    assert "unknown tool 'shell'" in observation[0]["content"] and not terminated
    observation, _, terminated, truncated, info = env.step(_call("import os\nos.kill(os.getppid(), 9)"))
    assert "os.kill is not allowed" in observation[0]["content"] and not terminated
    assert info["tool_errors"] == 3
    _, _, terminated, truncated, _ = env.step(_call("print(1)"))
    assert truncated and not terminated  # the turn budget


@pytest.mark.parametrize("reply,expected", [("The answer is 1,234.", 1234), ("-5 then 17", 17), ("no idea", None)])
def test_python_tool_final_answer(reply, expected):
    assert final_answer(reply) == expected


def test_reasoning_gym_adapter_builds_any_task_and_scores_with_it():
    env = molt_env.make("reasoning_gym:leg_counting", size=50)
    check_env(env, skip_render_check=True)
    messages, info = env.reset(seed=4)
    assert [m["role"] for m in messages] == ["system", "user"] and "<answer>" in messages[0]["content"]
    assert env.step(f"Counting... <answer>{info['answer']}</answer>")[1] == 1.0
    env.reset(seed=4)
    assert env.step(f"<answer>{int(info['answer']) + 1}</answer>")[1] == 0.0
    env.reset(seed=4)
    assert env.step(f"{info['answer']} (no tags)")[1] == 0.0
    with pytest.raises(ValueError, match="no task 'leg_countin'"):
        molt_env.make("reasoning_gym:leg_countin")


def test_shapes_draws_its_count_and_grades_the_first_digit():
    import numpy as np

    from environments.shapes import Shapes, draw

    env = Shapes()
    for seed in range(6):
        (message,), info = env.reset(seed=seed)
        image = message["content"][0]["image"]
        assert message["content"][0]["type"] == "image" and image.size == (56, 56)
        # Each shape fills part of its own cell of the 2 x 2 grid; the rest is background.
        cells = np.asarray(image).reshape(2, 28, 2, 28, 3).swapaxes(1, 2).reshape(4, -1)
        assert int((cells.max(axis=1) > 100).sum()) == info["count"]
        assert env.step(f"{info['count']} shapes")[1] == 1.0
        env.reset(seed=seed)
        assert env.step(f"{info['count'] % 3 + 1}")[1] == 0.0
    assert np.asarray(draw(np.random.default_rng(0), 3)).shape == (56, 56, 3)
