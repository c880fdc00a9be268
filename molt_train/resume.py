"""Resuming a run: its own config first, then only the flags given now, each change on record.

`RUN_DIR/config.yaml` is written once, when the run starts, and never
again. A resume starts from it plus the changes earlier resumes made
(`RUN_DIR/config_history.jsonl`, one line per resume), applies the flags
given now, and refuses any that would change what the run is: a different
environment, model, algorithm, batch shape or seed would make the steps
after the checkpoint a different experiment from the steps before it.
Flags that only say how long to run, where to log, how often to checkpoint
or evaluate (evaluation is never trained on) or which Ray cluster to join
may change; the change is appended to the
history with the step it applies from.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from molt_train.config import ConfigError

# Flags (or groups, ending in ".") a resumed run may change.
MAY_CHANGE = ("steps", "out", "resume", "dry_run", "log.", "ckpt.", "eval.", "ray.", "cluster.",
              "rollout.episode_timeout", "rollout.max_failed_steps")
HISTORY = "config_history.jsonl"


def may_change(flag: str) -> bool:
    return any(flag == name or (name.endswith(".") and flag.startswith(name)) for name in MAY_CHANGE)


def run_config(parser, run_dir: Path) -> dict:
    """The run's config as flat `{flag: value}`: `config.yaml` with every recorded change applied."""
    values = {k: v for k, v in parser.parse_path(str(run_dir / "config.yaml")).items() if k != "config"}
    history = run_dir / HISTORY
    for line in history.read_text().splitlines() if history.exists() else ():
        for flag, (_, now) in json.loads(line)["changes"].items():
            values[flag] = now
    return values


def changes(before: dict, now: dict) -> dict:
    """`{flag: [before, now]}` for the flags that differ; a ConfigError for one that may not."""
    changed = {flag: [before.get(flag), value] for flag, value in now.items()
               if flag not in ("out", "resume", "config") and before.get(flag) != value}
    refused = [flag for flag in changed if not may_change(flag)]
    if refused:
        shown = ", ".join(f"--{flag} {changed[flag][0]!r} -> {changed[flag][1]!r}" for flag in refused)
        allowed = ", ".join(f"--{name}*" if name.endswith(".") else f"--{name}" for name in MAY_CHANGE
                            if name not in ("out", "resume"))
        raise ConfigError(f"--resume: {shown} would change what the run is; a resumed run may change only "
                          f"{allowed} (start a new --out for a different run)")
    return changed


def record(run_dir: Path, changed: dict, step: int) -> None:
    """Append this resume's changes to the run's history (nothing when none)."""
    if changed:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "from_step": step, "changes": changed}
        with (run_dir / HISTORY).open("a") as out:
            out.write(json.dumps(entry) + "\n")
