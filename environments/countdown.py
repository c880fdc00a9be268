"""`countdown`: reach a target number from given numbers with + - * /.

Single turn. The policy writes an expression; the reward is 1 when it uses
each given number at most once, nothing else, and evaluates to the target;
0 otherwise. The answer is the last line containing digits (so reasoning
may come first), or what follows "Answer:".
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from fractions import Fraction

from molt_env import Env

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return Fraction(node.value)
    raise ValueError("only integers, + - * / and parentheses are allowed")


def extract_expression(reply: str) -> str | None:
    """The expression the reply commits to: after the last "Answer:", else its last line with a digit."""
    if "answer:" in reply.lower():
        reply = reply[reply.lower().rindex("answer:") + len("answer:"):]
    lines = [line.strip() for line in reply.splitlines() if re.search(r"\d", line)]
    if not lines:
        return None
    expression = lines[-1].split("=")[0].strip().rstrip(".")
    return expression or None


def score(reply: str, numbers: list[int], target: int) -> float:
    expression = extract_expression(reply)
    if expression is None:
        return 0.0
    try:
        tree = ast.parse(expression, mode="eval")
        value = _evaluate(tree)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    used, available = Counter(int(n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)), Counter(numbers)
    if any(used[n] > available[n] for n in used):
        return 0.0
    return float(value == target)


class Countdown(Env):
    def __init__(self, count: int = 3, max_number: int = 10):
        self.count, self.max_number = count, max_number

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.numbers = [int(n) for n in self.np_random.integers(1, self.max_number + 1, size=self.count)]
        # A reachable target: combine the numbers left to right with random operators.
        target = self.numbers[0]
        for n in self.numbers[1:]:
            target = [target + n, target * n, abs(target - n) or target + n][int(self.np_random.integers(0, 3))]
        self.target = target
        prompt = (f"Using the numbers {', '.join(map(str, self.numbers))} (each at most once) and + - * /, "
                  f"make {self.target}. Give the expression after 'Answer:'.")
        return prompt, {"numbers": self.numbers, "target": self.target}

    def step(self, action: str):
        return "", score(action, self.numbers, self.target), True, False, {"target": self.target}
