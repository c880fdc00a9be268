"""The agentic benchmark's task: `environments/locker.py`'s locker, without Molt, for both sides.

TRL's virtual environment has no Molt, so this file imports only numpy and
bench/workload.py. It holds what both sides must agree on:

- `episode(seed, group)`: the digits in lockers A to I and the asked locker,
  drawn as `Locker.reset` draws them from the episode's seeded generator
  (`workload.env_seed`, the generator Gymnasium seeds), so both sides see
  the same episodes in the same order;
- `LOOKUP` (the tool's schema, rendered into the prompt as it is), `prompt`;
- `LockerEpisode`: one episode's tool calls (`call`, the same strings as
  `Locker.call`) and its reward (`reward`, as `Locker.step` scores a final
  answer).

tests/test_bench_locker.py checks all of it against `environments.locker.Locker`
on a few hundred seeds, so the copy cannot drift from the task silently.
"""

from __future__ import annotations

import json

import numpy

import workload

LOOKUP = {"type": "function", "function": {  # environments.locker.LOOKUP
    "name": "lookup",
    "description": "The digit inside a locker; id is its letter's place in the alphabet (A is one, B is two...).",
    "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}
LETTERS = "ABCDEFGHI"  # Locker's default of 9 lockers
MAX_TURNS = 3  # replies per episode (Locker's default max_turns)

# A reply's tool calls wait this long (asyncio.sleep: time, no CPU) before the model can read their results;
# the calls of one reply overlap with each other on every side.
LATENCIES = {"0ms": 0.0, "100ms": 0.1}


def episode(seed: int, group: int) -> tuple[list[int], int]:
    """Prompt group `group` of run seed `seed`: the digit in each locker, and the asked locker (1 to 9)."""
    rng = numpy.random.default_rng(workload.env_seed(seed, group))
    digits = [int(d) for d in rng.integers(0, 10, size=len(LETTERS))]
    return digits, int(rng.integers(1, len(LETTERS) + 1))


def prompt(locker: int) -> str:
    return f"What is the digit in locker {LETTERS[locker - 1]}?"


def first_char(text: str) -> str:
    return text.strip()[:1]


def locker_number(arguments: str) -> int | str:
    """The locker number a `lookup` call's `arguments` (a JSON string) name, or the error the tool replies."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as error:
        return f"[error] arguments are not JSON ({error.msg})"
    number = parsed.get("id") if isinstance(parsed, dict) else None
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= len(LETTERS):
        return f'[error] arguments must be {{"id": <1 to {len(LETTERS)}>}}'
    return number


class LockerEpisode:
    """One episode's state: the lockers each `lookup` call named and the digit it last showed."""

    def __init__(self, digits: list[int], locker: int):
        self.digits, self.locker = digits, locker
        self.answer = digits[locker - 1]
        self.numbers: list[int | None] = []  # the locker each lookup call named (None: a malformed call)
        self.shown: int | None = None

    def call(self, name: str, arguments: str) -> str:
        """What the tool replies to one call (`arguments` a JSON string)."""
        if name != LOOKUP["function"]["name"]:
            return f"[error] unknown tool {name!r}; the only tool is lookup"
        number = locker_number(arguments)
        self.numbers.append(number if isinstance(number, int) else None)
        if isinstance(number, str):
            return number
        self.shown = self.digits[number - 1]
        return f"It holds {self.shown}."

    def reward(self, answer_text: str) -> float:
        """A final answer's reward: 1 when it starts with the asked locker's digit and a call opened it."""
        return float(first_char(answer_text) == str(self.answer) and self.locker in self.numbers)
