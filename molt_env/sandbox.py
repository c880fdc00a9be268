"""Run untrusted Python (a policy's tool call) in a separate, limited process.

`Sandbox().run(code)` writes the code into a fresh private temporary
directory, runs it there with the Python standard library only
(`python -I -S`), and returns what it printed, or a short error when it failed
or broke a limit. Nothing it does can raise in the caller: a tool failure is
an observation for the policy, and the episode goes on.

What it enforces, on Linux:

- wall time: the whole process group is killed after `timeout` seconds;
  CPU time: `RLIMIT_CPU`
- memory: `RLIMIT_AS` (address space), so an allocation past it raises
  `MemoryError` inside the sandbox
- output: stdout and stderr go to a file capped by `RLIMIT_FSIZE`; the
  caller sees at most `max_output` characters
- processes: fork, exec, spawn, subprocess and `os.system` are refused (an
  audit hook); when started as root the child also drops to user `nobody`,
  where `RLIMIT_NPROC` caps what it could start anyway; its own session, so
  the kill at the end takes everything it started
- files: opening, listing or changing anything outside its directory is
  refused, except reading the standard library (imports); the directory is
  deleted afterwards
- network: a new, empty network namespace when the kernel allows it (root,
  or unprivileged user namespaces), and socket creation is refused anyway
- signals: `os.kill` and friends are refused; as `nobody` it could not
  signal our processes in any case
- `ctypes` calls are refused (they would bypass the hook)

What it cannot promise: the audit hook is a Python-level guard, not a kernel
boundary. Native code that is already importable and does not go through
Python's audited calls (for example `_posixsubprocess.fork_exec`) is held
only by the OS limits above (`nobody`, `RLIMIT_NPROC`, the process-group
kill, the empty network namespace) and only where they apply. For hostile
code at scale, run the environment itself inside a container or a VM
(gVisor, Firecracker) as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
_CHILD = Path(__file__).with_name("_sandbox_child.py")


@dataclass
class SandboxResult:
    output: str  # what the code printed (stdout and stderr), truncated to max_output
    error: str | None  # None when it ran to the end; else why it did not
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None

    def message(self) -> str:
        """The text a tool message carries back to the policy."""
        if self.error is None:
            return self.output
        return f"{self.output}\n[error] {self.error}" if self.output.strip() else f"[error] {self.error}"


@dataclass
class Sandbox:
    timeout: float = 5.0  # wall-clock seconds
    cpu_seconds: int = 5
    memory_mb: int = 512
    max_output: int = 4096  # characters returned
    max_file_mb: int = 8  # any file it writes, its output included
    max_processes: int = 16  # RLIMIT_NPROC when it runs as nobody

    def run(self, code: str) -> SandboxResult:
        started = time.perf_counter()
        work = Path(tempfile.mkdtemp(prefix="molt-sandbox-"))
        try:
            (work / "main.py").write_text(code)
            as_nobody = os.geteuid() == 0
            if as_nobody:  # the child writes here after it drops to nobody
                os.chown(work, NOBODY, NOBODY)
            config = {"cpu": self.cpu_seconds, "memory": self.memory_mb << 20, "fsize": self.max_file_mb << 20,
                      "nproc": self.max_processes, "uid": NOBODY if as_nobody else None}
            with open(work / ".output", "wb") as output:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(_CHILD), json.dumps(config)], cwd=work,
                    stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"})
                try:
                    process.wait(self.timeout)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    timed_out = True
                with contextlib.suppress(ProcessLookupError, PermissionError):  # whatever it started goes too
                    os.killpg(process.pid, signal.SIGKILL)
                exit_code = process.wait()
            size = (work / ".output").stat().st_size
            with open(work / ".output", "rb") as output:
                text = output.read(self.max_output * 4).decode("utf-8", errors="replace")
            return SandboxResult(*self._outcome(text, size, exit_code, timed_out), time.perf_counter() - started)
        except Exception as error:  # never the caller's problem: report it as the tool's failure
            return SandboxResult("", f"the sandbox could not run the code: {error}", time.perf_counter() - started)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _outcome(self, text: str, size: int, exit_code: int, timed_out: bool) -> tuple[str, str | None]:
        truncated = len(text) > self.max_output or size > len(text.encode())
        if len(text) > self.max_output:
            text = text[: self.max_output]
        if truncated:
            text += f"\n[output truncated: {size} bytes in all]"
        if timed_out:
            return text, f"timeout: the code ran past {self.timeout:g} s and was killed"
        if size >= self.max_file_mb << 20:
            return text, f"output limit: the code wrote over {self.max_file_mb} MB and was stopped"
        if exit_code < 0:
            name = signal.Signals(-exit_code).name
            reason = {"SIGXCPU": f"CPU time limit ({self.cpu_seconds} s)", "SIGKILL": "killed"}.get(name, name)
            return text, f"terminated: {reason}"
        if exit_code != 0:
            last = text.strip().splitlines()[-1] if text.strip() else f"exit code {exit_code}"
            return text, last
        return text, None
