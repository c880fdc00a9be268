"""`locker`: open a locker with a tool and report the digit inside; the reward needs the tool's result.

Multi-turn with tool use. Each episode hides a random digit in each of the
lockers 1 to 9 and asks for one of them. The digits are drawn per episode,
so the answer cannot be known without calling the `lookup` tool with that
locker's number as its `id`; the tool replies with a sentence that holds the
digit inside ("It holds 5.": the asked locker's or, for a wrong number,
another one's). A reply without a tool call is the final answer: reward 1
when it starts with the asked locker's digit (as `digit` grades), else 0; a
digit further on does not count, so a broken tool call that carries the
digit scores nothing. Running out of turns truncates the episode with
reward 0.

`BlankLocker` is the control: the same task with the tool's output blanked,
so that nothing read can tell the answer.
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
        "description": "The digit inside the locker numbered id.",
        "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
    },
}


def lookup(arguments: str, digits: list[int]) -> str:
    """The tool: the digit in the locker that `arguments` names, or an error that says what is wrong."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as error:
        return f"[error] arguments are not JSON ({error.msg})"
    locker = parsed.get("id") if isinstance(parsed, dict) else None
    if not isinstance(locker, int) or isinstance(locker, bool) or not 1 <= locker <= len(digits):
        return f'[error] arguments must be {{"id": <1 to {len(digits)}>}}'
    return f"It holds {digits[locker - 1]}."


class Locker(Env):
    tools = [LOOKUP]
    blank = False

    def __init__(self, max_turns: int = 3, lockers: int = 9):
        self.max_turns, self.lockers = max_turns, lockers

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.digits = [int(d) for d in self.np_random.integers(0, 10, size=self.lockers)]
        self.locker = int(self.np_random.integers(1, self.lockers + 1))
        self.answer = self.digits[self.locker - 1]
        self.turns, self.calls = 0, 0
        prompt = f"What is the digit in locker {self.locker}?"
        return prompt, {"locker": self.locker, "answer": self.answer}

    def step(self, action: str):
        self.turns += 1
        _, calls = parse_reply(action)
        if not calls:  # the final answer
            reward = float(first_char(action) == str(self.answer))
            return "", reward, True, False, self._info()
        results = [{"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                    "content": self.call(call["function"]["name"], call["function"]["arguments"])} for call in calls]
        return results, 0.0, False, self.turns >= self.max_turns, self._info()

    def call(self, name: str, arguments: str) -> str:
        """Run one tool call (`arguments` a JSON string) and return what the tool says: also for agents
        that call the tool themselves (`environments.agents.LockerAgent`)."""
        self.calls += 1
        if name != LOOKUP["function"]["name"]:
            return f"[error] unknown tool {name!r}; the only tool is lookup"
        result = lookup(arguments, self.digits)
        return "" if self.blank and not result.startswith("[error]") else result

    def _info(self) -> dict:
        return {"turns": self.turns, "tool_calls": self.calls}


class BlankLocker(Locker):
    """The control: `lookup` answers, but with its output blanked."""

    blank = True
