"""`arithmetic`: add or subtract two numbers; the default environment.

Single turn. The reward is 1 when the last number in the reply is the
answer, else 0. Small enough that the tiny model can learn parts of it on a CPU.
"""

from __future__ import annotations

import re

from molt_env import Env

_NUMBER = re.compile(r"-?\d+")


def last_number(text: str) -> int | None:
    """The last integer written in `text`, or None."""
    found = _NUMBER.findall(text)
    return int(found[-1]) if found else None


class Arithmetic(Env):
    def __init__(self, max_operand: int = 20):
        self.max_operand = max_operand

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        a, b = (int(x) for x in self.np_random.integers(0, self.max_operand + 1, size=2))
        op = "+" if self.np_random.random() < 0.5 else "-"
        self.answer = a + b if op == "+" else a - b
        return f"What is {a} {op} {b}? Reply with the number.", {"answer": self.answer}

    def step(self, action: str):
        correct = last_number(action) == self.answer
        return "", float(correct), True, False, {"answer": self.answer}
