"""What a run shows on the terminal, and where everything else goes.

By default (`--log.verbose false`) the terminal gets the resolved config,
one line per phase of start-up, the progress bar and real problems; all
other output of the driver and of every Ray actor (third-party warnings,
vLLM's notices, library progress bars) goes to `RUN_DIR/molt.log`. That is
done at the file-descriptor level, so output from C extensions is caught
too. A failure is one line on the terminal naming its cause, with the full
traceback in the log.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import TextIO

from molt_train.startup import Startup

LOG = "molt.log"


class Console:
    def __init__(self, run_dir: Path, verbose: bool, prog: str = "molt-train"):
        self.log_path, self.prog = run_dir / LOG, prog
        self.startup = Startup()
        sys.stdout.flush()
        sys.stderr.flush()
        if verbose:
            self.terminal: TextIO = sys.stdout
            return
        self.terminal = os.fdopen(os.dup(1), "w", buffering=1)
        log = open(self.log_path, "a", buffering=1)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        log.close()

    def say(self, line: str) -> None:
        print(line, file=self.terminal, flush=True)

    def phase(self, what: str, ended: str | None = None) -> None:
        """One line of start-up, with the seconds since the command; `ended`: the phase it ends (`Startup`)."""
        if ended:
            self.startup.mark(ended)
        self.say(f"# {what} ({self.startup.since_command():.0f} s)")

    def progress(self, total: int, done: int):
        from tqdm import tqdm

        return tqdm(total=total, initial=done, desc=self.prog, unit="step", dynamic_ncols=True,
                    file=self.terminal)

    def failed(self, error: BaseException) -> str:
        """Write the traceback to the log; the one line for the terminal."""
        with open(self.log_path, "a") as log:
            traceback.print_exception(error, file=log)
        return f"{self.prog}: {cause(error)} (traceback in {self.log_path})"


class StartupError(RuntimeError):
    """A part of the run failed to start; the message names the part and the cause."""


def cause(error: BaseException) -> str:
    """One line: the original exception behind `error`, also when it crossed a Ray actor."""
    from molt_train.config import ConfigError

    if isinstance(error, (StartupError, ConfigError)):
        return str(error)
    original = getattr(error, "cause", None)  # a Ray task error carries the exception it wraps
    if isinstance(original, BaseException):
        error = original
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if type(error).__module__.startswith("ray.") and lines:  # an actor died: its message ends in the cause
        return _first_sentences(_plain(lines[-1]))
    return f"{type(error).__name__}: {_plain(lines[0]) if lines else ''}".rstrip(": ")


def _first_sentences(text: str, limit: int = 200) -> str:
    """Ray's own messages go on with advice for other setups; keep what fits in `limit` characters."""
    kept = ""
    for sentence in text.split(". "):
        if kept and len(kept) + len(sentence) > limit:
            return kept + "."
        kept = f"{kept}. {sentence}" if kept else sentence
    return kept


def _plain(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)
