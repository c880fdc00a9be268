"""Saved rollouts: `--log.rollouts` keeps what the policy did, in RUN_DIR/rollouts/.

Every trained episode's segments, and every evaluation play's, as one JSON
line each: `Trajectory.to_dict()` (the schema of `molt-serve --trajectories`:
messages, token ids, mask, engine logprobs, versions, reward, env info) with
`step` (the step that trained it, or that the evaluation followed: 0 before
training) and `split` ("train" or "eval"; an evaluation play also has its
`episode` and `sample`). Files are gzipped, one per `--log.rollouts_every`
steps (`steps_000001.jsonl.gz` holds steps 1 to N), each step appended as a
gzip member of its own: a run killed while writing loses that step's member
at most, and `read` stops at the last whole line. `--log.rollouts_groups K`
keeps the first K groups of each step, a bound for long runs.

A resumed run first drops the steps its checkpoint does not cover (written
after the checkpoint, before the run stopped) and appends from there, so a
file holds each step once.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from molt_train.batch import Group


def read(path: Path) -> Iterator[dict]:
    """The records of a file of saved rollouts, up to the last whole line (a half-written end is skipped)."""
    with gzip.open(path, "rt") as lines:
        try:
            for line in lines:
                if not line.endswith("\n"):
                    return
                yield json.loads(line)
        except (EOFError, gzip.BadGzipFile, zlib.error, json.JSONDecodeError):
            return


class RolloutLog:
    def __init__(self, run_dir: Path, log, resume_step: int = 0):
        """`log`: the run's `LogConfig`; `resume_step`: the step of the checkpoint a resumed run starts from."""
        self.dir, self.every, self.groups = run_dir / "rollouts", log.rollouts_every, log.rollouts_groups
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.dir.glob("steps_*.jsonl.gz")):
            records = list(read(path))
            kept = [record for record in records if record["step"] <= resume_step]
            if len(kept) == len(records):
                continue
            if kept:
                partial = path.with_suffix(".partial")
                with gzip.open(partial, "wt") as out:
                    out.writelines(_line(record) for record in kept)
                partial.replace(path)
            else:
                path.unlink()

    def write(self, step: int, groups: list[Group], plays: list[dict] | None = None) -> None:
        """A step's trained groups (the first `rollouts_groups`), and the evaluation `plays` that followed it
        (their records as the rollout workers return them, with `trajectories`)."""
        records = [{"step": step, "split": "train", **trajectory.to_dict()}
                   for group in groups[:self.groups or None] for trajectory in group.trajectories]
        records += [{"step": step, "split": "eval", "episode": play["episode"], "sample": play["sample"], **trajectory}
                    for play in plays or () for trajectory in play["trajectories"]]
        if records:
            with gzip.open(self.path(step), "at") as out:  # a gzip member per step
                out.writelines(_line(record) for record in records)

    def path(self, step: int) -> Path:
        first = (max(step, 1) - 1) // self.every * self.every + 1
        return self.dir / f"steps_{first:06d}.jsonl.gz"


def _line(record: dict) -> str:
    return json.dumps(record, default=_plain) + "\n"


def _plain(value):
    """What an environment's info or an observation may hold that JSON does not: numpy values as numbers and
    lists, anything else (a picture) named by its type."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return f"<{type(value).__name__}>"
