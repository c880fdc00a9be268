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

NAMES = ["digit", "arithmetic", "countdown", "guess_number", "frozen_lake"]


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
