"""`guess_number`: find a hidden number from the environment's hints.

Multi-turn, env-driven. The reward for finding the number is 1 minus 0.1 per
extra guess (at least 0.1); an episode truncates after `max_turns` guesses
with reward 0. A reply without a number counts as a wasted guess. By default
the number is a digit and there are 4 guesses.

The hint after a wrong guess (`hint`):
  - "direction" (`guess_number`): "higher" or "lower". Halving always wins
    within 4 guesses; a policy that ignores the hints can at best try four
    fixed digits (0.34 in expectation; a uniformly random one gets 0.29).
  - "told" (`guess_number_told`): "No: it is 7. Guess again." The number is
    in the second turn's observation and nowhere before it: a policy that
    reads it wins on its second guess (0.1 + 0.9 * 0.9 = 0.91).
  - "none": "Guess again.", the same string whatever was guessed: the
    control that shows what the hints are worth (`GuessNumberNoFeedback`).
"""

from __future__ import annotations

from environments.arithmetic import last_number
from molt_env import Env

HINTS = ("direction", "told", "none")


class GuessNumber(Env):
    def __init__(self, low: int = 0, high: int = 9, max_turns: int = 4, hint: str = "direction"):
        if hint not in HINTS:
            raise ValueError(f"hint={hint!r}: choose one of {', '.join(HINTS)}")
        self.low, self.high, self.max_turns, self.hint = low, high, max_turns, hint

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(self.low, self.high + 1))
        self.turns = 0
        how = "I will say higher or lower" if self.hint == "direction" else "I will tell you if you are wrong"
        return (f"I am thinking of a number between {self.low} and {self.high}. Guess it; "
                f"{how}. Reply with one number."), {"secret": self.secret}

    def step(self, action: str):
        self.turns += 1
        guess = last_number(action)
        if guess == self.secret:
            return "", max(1.0 - 0.1 * (self.turns - 1), 0.1), True, False, {"turns": self.turns}
        if self.turns >= self.max_turns:
            return "", 0.0, False, True, {"turns": self.turns}
        return self._hint(guess), 0.0, False, False, {"turns": self.turns}

    def _hint(self, guess: int | None) -> str:
        if self.hint == "none":
            return "Guess again."
        if guess is None:
            return "No number there. Guess a number."
        if self.hint == "told":
            return f"No: it is {self.secret}. Guess again."
        return "higher" if guess < self.secret else "lower"


class GuessNumberNoFeedback(GuessNumber):
    """The control: the same game with every hint replaced by "Guess again."."""

    def __init__(self, low: int = 0, high: int = 9, max_turns: int = 4):
        super().__init__(low, high, max_turns, hint="none")
