"""`locker`: open a locker with a tool and report the digit inside; the reward needs the tool's result.

Multi-turn with tool use. Each episode hides a random digit in each of the
lockers A to I and asks for one of them by its letter. The digits are drawn
per episode, so the answer cannot be known without calling the `lookup`
tool, whose `id` is the locker's number (A is 1, B is 2, ..., as its
description says in words: digits in the tools block would draw a tiny
model's copy of a digit away from the tool's reply); the tool replies with
a sentence that holds the digit inside ("It holds 5.": the asked locker's
or, for a wrong number, another one's). A reply without a tool call is the
final answer: reward 1 when it starts with the asked locker's digit (as
`digit` grades) and a `lookup` call of the episode opened that locker, else
0. An answer the episode never read pays nothing: a guess, right one time
in ten, would pay about what an untrained call pays, and a run could learn
to stop calling. A digit further on does not count, so a broken tool call
that carries the digit scores nothing. Running out of turns truncates the
episode with reward 0.

What a policy must learn is the task's own mapping: which number to call
with for a letter (1 in 9 by chance) and to answer with what the tool
returned. The episode's info says how it did (averaged per step into the
run's `env/*` metrics): `tool_calls` (of any name), `called` (a `lookup`
call), `right_id` (its first `lookup` call named the asked locker) and
`read_result` (the answer starts with the digit the last `lookup` returned).

`BlankLocker` is the control: the same task with the tool's output blanked,
so that nothing read can tell the answer: it earns only the one time in ten
that its guess after opening the asked locker is right.
"""

from __future__ import annotations

import json

from environments.digit import first_char
from molt_agents.tool_calls import parse_reply
from molt_env import Env

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The digit inside a locker; id is its letter's place in the alphabet "
                       "(A is one, B is two...).",
        "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
    },
}


def locker_number(arguments: str, lockers: int) -> int | str:
    """The locker number a `lookup` call's `arguments` name, or an error that says what is wrong."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as error:
        return f"[error] arguments are not JSON ({error.msg})"
    number = parsed.get("id") if isinstance(parsed, dict) else None
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= lockers:
        return f'[error] arguments must be {{"id": <1 to {lockers}>}}'
    return number


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class Locker(Env):
    tools = [LOOKUP]
    blank = False

    def __init__(self, max_turns: int = 3, lockers: int = 9):
        if not 1 <= lockers <= len(LETTERS):
            raise ValueError(f"lockers={lockers}: choose 1 to {len(LETTERS)} (one letter each)")
        self.max_turns, self.lockers = max_turns, lockers

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.digits = [int(d) for d in self.np_random.integers(0, 10, size=self.lockers)]
        self.locker = int(self.np_random.integers(1, self.lockers + 1))
        self.answer = self.digits[self.locker - 1]
        self.turns, self.calls = 0, 0
        self.numbers: list[int | None] = []  # the locker each lookup call named (None: a malformed call)
        self.shown: int | None = None  # the digit the last lookup showed
        self.read_result = False
        prompt = f"What is the digit in locker {LETTERS[self.locker - 1]}?"
        return prompt, {"locker": self.locker, "answer": self.answer}

    def step(self, action: str):
        self.turns += 1
        _, calls = parse_reply(action)
        if not calls:  # the final answer
            reward = float(first_char(action) == str(self.answer) and self.locker in self.numbers)
            self.read_result = self.shown is not None and first_char(action) == str(self.shown)
            return "", reward, True, False, self.facts()
        results = [{"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                    "content": self.call(call["function"]["name"], call["function"]["arguments"])} for call in calls]
        return results, 0.0, False, self.turns >= self.max_turns, self.facts()

    def call(self, name: str, arguments: str) -> str:
        """Run one tool call (`arguments` a JSON string) and return what the tool says: also for agents
        that call the tool themselves (`environments.agents.LockerAgent`)."""
        self.calls += 1
        if name != LOOKUP["function"]["name"]:
            return f"[error] unknown tool {name!r}; the only tool is lookup"
        number = locker_number(arguments, self.lockers)
        self.numbers.append(number if isinstance(number, int) else None)
        if isinstance(number, str):
            return number
        if self.blank:
            return ""
        self.shown = self.digits[number - 1]
        return f"It holds {self.shown}."

    def facts(self) -> dict:
        """What the episode did so far: the environment's info (see the module docstring)."""
        return {"tool_calls": self.calls, "called": bool(self.numbers),
                "right_id": bool(self.numbers) and self.numbers[0] == self.locker, "read_result": self.read_result}


class BlankLocker(Locker):
    """The control: `lookup` answers, but with its output blanked."""

    blank = True
