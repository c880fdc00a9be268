"""Where a run's start-up goes: seconds from the command to the first optimizer step, by phase.

The driver's phases follow one another: `command` (the interpreter, imports,
the config and its checks), `ray`, `placement`, `actors` (the trainer and
the rollout workers, started at once), `weight_sync` (the channel),
`first_rollouts` (until the first step's groups are in) and `first_step`
(its training). Inside `actors`, each side's own start is reported too:
`trainer` and `engines` (from the actors' creation until each answered:
process, imports, model load), and within those `trainer_init` and
`engine_init` (the slowest actor's constructor: the model's load and
sharding, the engine's build). `total` is the command to the end of the
first optimizer step. They are logged once, on the first step a process
trains, as `time/startup/<phase>`.
"""

from __future__ import annotations

import time

import psutil


class Startup:
    def __init__(self):
        self.began = psutil.Process().create_time()  # when this process (the command, for the driver) started
        self.last = self.began
        self.seconds: dict[str, float] = {}

    def since_command(self) -> float:
        return time.time() - self.began

    def mark(self, phase: str) -> None:
        """`phase` ended now; it began when the one before it ended."""
        now = time.time()
        self.seconds[phase] = now - self.last
        self.last = now

    def add(self, phase: str, seconds: float) -> None:
        """A phase that overlapped others (an actor's own start)."""
        self.seconds[phase] = seconds

    def metrics(self) -> dict[str, float]:
        """Every phase so far, and the total since the command."""
        return {f"time/startup/{phase}": seconds for phase, seconds in self.seconds.items()} | {
            "time/startup/total": self.last - self.began}
