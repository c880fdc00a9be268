"""`digit`: repeat a digit; the default environment.

Single turn: "Repeat the digit 7." The reward is 1 when the reply starts with
that digit, else 0. A task the tiny model learns by RL on a CPU in minutes:
the built-in warm start teaches it only the reply format (one digit, then the
end of the turn) on unrelated prompts, with random digits, so it starts near
chance (0.1) and RL must learn which digit to say.
"""

from __future__ import annotations

from molt_env import Env


def first_char(text: str) -> str:
    return text.strip()[:1]


class Digit(Env):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.digit = str(int(self.np_random.integers(0, 10)))
        return f"Repeat the digit {self.digit}.", {"digit": self.digit}

    def step(self, action: str):
        return "", float(first_char(action) == self.digit), True, False, {"digit": self.digit}
