"""`guess_number`: find a hidden number; the environment answers "higher" or "lower".

Multi-turn, env-driven. The reward for finding the number is 1 minus 0.1 per
extra guess (at least 0.1); an episode truncates after `max_turns` guesses
with reward 0. A reply without a number counts as a wasted guess.
"""

from __future__ import annotations

import re

from molt_env import Env


def parse_guess(reply: str) -> int | None:
    found = re.findall(r"-?\d+", reply)
    return int(found[-1]) if found else None


class GuessNumber(Env):
    def __init__(self, low: int = 1, high: int = 20, max_turns: int = 6):
        self.low, self.high, self.max_turns = low, high, max_turns

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(self.low, self.high + 1))
        self.turns = 0
        return (f"I am thinking of a number between {self.low} and {self.high}. Guess it; "
                "I will say higher or lower. Reply with one number."), {"secret": self.secret}

    def step(self, action: str):
        self.turns += 1
        guess = parse_guess(action)
        if guess == self.secret:
            return "", max(1.0 - 0.1 * (self.turns - 1), 0.1), True, False, {"turns": self.turns}
        if self.turns >= self.max_turns:
            return "", 0.0, False, True, {"turns": self.turns}
        hint = "No number there. Guess a number." if guess is None else ("higher" if guess < self.secret else "lower")
        return hint, 0.0, False, False, {"turns": self.turns}
