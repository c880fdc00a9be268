"""Molt's side of the benchmark task: "a+b=", reward 1 for exactly the sum (see `workload`)."""

from __future__ import annotations

import sys
from pathlib import Path

from molt_env import Env

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402


class Addition(Env):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        a, b = workload.operands(self.np_random)
        self.answer = a + b
        return workload.prompt(a, b), {"answer": self.answer}

    def step(self, action: str):
        return "", workload.reward(action, self.answer), True, False, {"answer": self.answer}
