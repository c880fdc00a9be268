"""`python_tool`: compute a number with a Python tool; the final answer is graded.

Multi-turn with tool use. The prompt asks for a value that is tedious to
work out by hand (a modular power); the policy may call the `python` tool in
its chat template's tool-call format, any number of times within
`max_turns`. Each call runs in a `molt_env.sandbox.Sandbox` (a separate,
limited process) and comes back as a tool message: the printed output, or
the error (a timeout, a refused operation, a traceback). A reply without a
tool call is the final answer: reward 1 when its last integer is the value,
else 0. Running out of turns truncates the episode with reward 0.
"""

from __future__ import annotations

import json

from environments.arithmetic import last_number
from molt_agents.tool_calls import parse_reply
from molt_env import Env
from molt_env.sandbox import Sandbox

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code (standard library only) and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                       "required": ["code"]},
    },
}


def final_answer(reply: str) -> int | None:
    """The last integer in a final reply (None when it has none)."""
    return last_number(reply.replace(",", ""))


def python_call(sandbox: Sandbox, name: str, arguments: str) -> tuple[str, bool]:
    """Run one call of the `python` tool (`arguments` a JSON string) in `sandbox`: the tool's reply (what the
    code printed, or the error) and whether the code ran without one."""
    if name != "python":
        return f"[error] unknown tool {name!r}; the only tool is python", False
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as error:
        return f"[error] arguments are not JSON ({error.msg})", False
    if not isinstance(parsed, dict) or not isinstance(parsed.get("code"), str):
        return '[error] arguments must be a JSON object with a "code" string', False
    result = sandbox.run(parsed["code"])
    return result.message(), result.ok


class PythonTool(Env):
    tools = [PYTHON_TOOL]

    def __init__(self, max_turns: int = 4, sandbox: Sandbox | None = None):
        self.max_turns = max_turns
        self.sandbox = sandbox or Sandbox()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        base, power, modulus = (int(self.np_random.integers(2, 100)), int(self.np_random.integers(10, 40)),
                                int(self.np_random.integers(1000, 10000)))
        self.answer = pow(base, power, modulus)
        self.turns, self.calls, self.errors = 0, 0, 0
        prompt = (f"What is ({base} ** {power}) % {modulus}? You can run Python with the python tool. "
                  "When you know it, reply with the number.")
        return prompt, {"answer": self.answer}

    def step(self, action: str):
        self.turns += 1
        _, calls = parse_reply(action)
        if not calls:  # the final answer
            reward = float(final_answer(action) == self.answer)
            return "", reward, True, False, self._info()
        results = [{"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                    "content": self._call(call["function"])} for call in calls]
        truncated = self.turns >= self.max_turns
        return results, 0.0, False, truncated, self._info()

    def _call(self, function: dict) -> str:
        self.calls += 1
        reply, ran = python_call(self.sandbox, function["name"], function["arguments"])
        self.errors += not ran
        return reply

    def _info(self) -> dict:
        return {"turns": self.turns, "tool_calls": self.calls, "tool_errors": self.errors}
