"""Stopping a run well: SIGTERM (a scheduler's preemption: Kubernetes, Slurm) and Ctrl-C end it at a step
boundary, with a checkpoint of the last finished step.

The first signal asks the loop to stop: a step being trained finishes, a wait for rollouts is abandoned
(the groups it waited for are started again on resume, with the same seeds), the last finished step is
saved unless it already was, and the run exits with 128 + the signal's number (143 for SIGTERM, 130 for
Ctrl-C), so `--resume` redoes nothing. A second signal of the same kind acts at once, as it would without
Molt: SIGTERM ends the process, Ctrl-C raises `KeyboardInterrupt`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """The run stopped on a signal after saving its last finished step."""

    def __init__(self, received: signal.Signals, message: str):
        super().__init__(message)
        self.exit_code = 128 + int(received)


class StopSignals:
    """The signals a run stops on, caught on the running event loop while installed (the main thread only:
    elsewhere, as in a test that drives the loop from a thread, signals keep their default handlers)."""

    def __init__(self):
        self.received: signal.Signals | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def install(self) -> StopSignals:
        self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
        if threading.current_thread() is threading.main_thread():
            for received in SIGNALS:
                self._loop.add_signal_handler(received, self._receive, received)
        return self

    def remove(self) -> None:
        if self._loop is not None and threading.current_thread() is threading.main_thread():
            for received in SIGNALS:
                self._loop.remove_signal_handler(received)

    def _receive(self, received: signal.Signals) -> None:
        self.received = signal.Signals(received)
        self._event.set()
        self._loop.remove_signal_handler(received)  # the next one acts at once

    async def unless_stopped(self, awaitable):
        """`awaitable`'s result, or None when a stop signal comes first (the awaitable is cancelled)."""
        task = asyncio.ensure_future(awaitable)
        if self.received is None:
            waiting = asyncio.ensure_future(self._event.wait())
            await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
