"""The stepping shared by every backend: async requests in, one step at a time.

A backend implements four methods that run where the engine steps: start a
request, advance all running requests by one step, abort requests, reload
weights. This class owns the rest: coroutines submit work and await
futures; all running requests advance together in each step, so concurrent
requests batch; a pause takes effect between two steps, and so does a
weight update, which is why every token can be stamped with the exact
version of the weights that sampled it. A hold (`hold`) lets requests in
but runs no step before the weights of a given version are loaded: a
synchronous trainer starts the next step's episodes as it syncs the
weights, and their tokens are still all sampled by the new weights.

Where the steps run (`stepping`):
- `"thread"` (GPU engines): on an engine thread of its own, so the event
  loop goes on with its episodes while the device computes a step.
- `"loop"` (CPU engines): in a task on the event loop of the requests. On a
  CPU the step's compute and the loop's Python share the cores and the
  GIL: a step on a thread gives the GIL back at each of its hundreds of
  small ops and waits up to the switch interval to get it back while the
  loop runs Python (bench/README.md compares the two). Taking turns
  instead, the loop runs what the last step woke (the next requests join
  the next step), then the step runs.
  The stepper lives on the loop that first asks something of the engine
  and moves to a new one when that loop ends; requests from other threads'
  loops still work (they wake it and get their results thread-safely), but
  that loop must not block on them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from molt_agents.engines.base import Sample, SamplingParams

if TYPE_CHECKING:
    from molt_agents.multimodal import PromptImages

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str = "stop"
    routes: object | None = None  # set when finished, if the backend captures expert routes
    error: str | None = None  # the backend refused the request after it started: fail it with this


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    prompt_len: int
    want_top: bool
    index: int = 0
    on_tokens: Callable[[int, Progress], None] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


def fit_routes(routes, length: int):
    """Expert routes as int16 `[length, layers, top_k]`: rows the backend did not report are -1."""
    if routes is None:
        return None
    import numpy as np

    routes = np.asarray(routes, dtype=np.int16)[:length]
    if len(routes) < length:
        routes = np.concatenate([routes, np.full((length - len(routes), *routes.shape[1:]), -1, np.int16)])
    return routes


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _notify(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Run `fn(*args)` on `loop` (soon: from its own thread without a wake-up); False if that loop is gone
    (its caller went away)."""
    try:
        if loop is _running_loop():
            loop.call_soon(fn, *args)
        else:
            loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # the event loop is closed
        return False


def _run_calls(calls: list[tuple]) -> None:
    """On an event loop: one engine step's callbacks for it, in order."""
    for fn, args, _ in calls:
        try:
            fn(*args)
        except Exception:  # a caller's `on_tokens` failed: the others still get theirs
            log.exception("a token callback failed")


def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # the awaiting coroutine was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class SteppedEngine:
    """Base of the engines; subclasses implement the four `_backend_*` methods and choose `stepping`."""

    def __init__(self, stepping: str = "thread"):
        if stepping not in ("thread", "loop"):
            raise ValueError(f"stepping must be 'thread' or 'loop', not {stepping!r}")
        self.version = 0
        self.stepping = stepping
        self._pending: dict[str, _Pending] = {}  # touched only where the engine steps
        self._request_ids = itertools.count()
        self._inbox: deque[tuple[Callable, asyncio.AbstractEventLoop]] = deque()  # jobs, and whose loop asked
        self._paused = False
        self._held_until = 0  # no step before the weights of this version are loaded (`hold`)
        self._closed = False
        self._dead: BaseException | None = None
        self._busy = threading.RLock()  # held while jobs or a step run (`close` waits for it)
        if stepping == "thread":
            self._wake = threading.Event()
            self._thread = threading.Thread(target=self._run, name=f"molt-{type(self).__name__}", daemon=True)
            self._thread.start()
        else:
            self._stepper: asyncio.Task | None = None
            self._stepper_loop: asyncio.AbstractEventLoop | None = None
            self._stepper_wake: asyncio.Event | None = None

    # ------------------------------------------------------------------
    # Backend interface (where the engine steps)

    def _backend_start(self, request_id: str, prompt_ids: list[int], params: SamplingParams, index: int,
                       images: PromptImages | None = None) -> None:
        raise NotImplementedError

    def _backend_step(self) -> list[Progress]:
        raise NotImplementedError

    def _backend_has_work(self) -> bool:
        raise NotImplementedError

    def _backend_abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def _backend_reload(self, named_tensors) -> None:
        raise NotImplementedError

    def _backend_close(self) -> None:
        pass

    # ------------------------------------------------------------------
    # Public async interface

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: Callable[[int, Progress], None] | None = None,
                       images: PromptImages | None = None) -> list[Sample]:
        """Sample `params.n` completions; `on_tokens(choice_index, progress)` sees each step's tokens;
        `images`: the prompt's images (pictures, tensors and their spans in `prompt_ids`)."""
        if not prompt_ids or not all(isinstance(t, int) and t >= 0 for t in prompt_ids):
            raise ValueError("prompt_ids must be a non-empty list of token ids")
        loop = asyncio.get_running_loop()
        requests = [(f"molt-{next(self._request_ids)}", loop.create_future()) for _ in range(params.n)]

        def submit():
            for index, (request_id, future) in enumerate(requests):
                self._backend_start(request_id, list(prompt_ids), params, index, images)
                self._pending[request_id] = _Pending(loop, future, len(prompt_ids), bool(params.top_logprobs),
                                                     index, on_tokens)

        await self._queue(submit)
        try:
            return list(await asyncio.gather(*(future for _, future in requests)))
        except asyncio.CancelledError:
            ids = [request_id for request_id, _ in requests]
            self._submit(lambda: self._abort(ids), loop)
            raise

    async def pause(self) -> None:
        await self._queue(lambda: setattr(self, "_paused", True))

    async def resume(self) -> None:
        await self._queue(lambda: setattr(self, "_paused", False))

    def hold(self, version: int) -> None:
        """From now on, requests are started but no step runs until the weights of `version` are loaded
        (`update_weights`): a request started under the hold is sampled by those weights from its first
        token on. The caller sees to it that they come."""
        self._queue(lambda: setattr(self, "_held_until", max(self._held_until, version)))

    @property
    def computing_version(self) -> int:
        """The version of the weights that will compute a request started now (where the engine steps): the
        loaded one, or the one a hold waits for."""
        return max(self.version, self._held_until)

    async def sleep(self) -> None:
        """Release the device memory of the weights and the KV cache (GPU engines); `wake` takes it back."""
        await self._queue(self._backend_sleep)

    async def wake(self) -> None:
        await self._queue(self._backend_wake)

    def _backend_sleep(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot sleep")

    def _backend_wake(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot sleep")

    async def update_weights(self, named_tensors) -> int:
        """Load `(hf_name, tensor)` pairs in place between two steps; returns the new version.

        Tokens sampled after it carry the new version; requests in flight continue.
        """
        return await self.queue_update(named_tensors)

    def queue_update(self, named_tensors) -> asyncio.Future:
        """`update_weights`, queued now: the engine loads the weights before anything asked of it after this
        call. The future gives the new version (or the load's error)."""

        def load():
            self._backend_reload(named_tensors)
            self.version += 1
            return self.version

        return self._queue(load)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.stepping == "thread":
            self._wake.set()
            self._thread.join(timeout=30)
        else:
            with self._busy:  # a step on another thread's loop finishes first
                self._fail_all(RuntimeError("the engine was closed"))
            self._wake_stepper()
        self._backend_close()

    # ------------------------------------------------------------------
    # Stepping: the engine thread, or the stepper task on an event loop

    def _submit(self, job, loop: asyncio.AbstractEventLoop) -> None:
        self._inbox.append((job, loop))
        if self.stepping == "thread":
            self._wake.set()
        elif not self._wake_stepper():
            self._start_stepper()

    def _wake_stepper(self) -> bool:
        """Loop stepping: wake the stepper task; False if there is none (or its loop is not running)."""
        stepper, loop = self._stepper, self._stepper_loop
        if stepper is None or stepper.done():
            return False
        if loop is _running_loop():
            self._stepper_wake.set()
            return True
        if not loop.is_running():  # closed, or stopped for now: step here instead (`_busy` keeps turns)
            return False
        try:
            loop.call_soon_threadsafe(self._stepper_wake.set)
            return True
        except RuntimeError:  # the loop is closed
            return False

    def _start_stepper(self) -> None:
        loop = asyncio.get_running_loop()
        self._stepper_loop, self._stepper_wake = loop, asyncio.Event()
        self._stepper = loop.create_task(self._steps(self._stepper_wake), name=f"molt-{type(self).__name__}")

    async def _steps(self, wake: asyncio.Event) -> None:
        """Loop stepping: run the jobs, then a step, taking turns with the loop's other tasks."""
        loop = asyncio.get_running_loop()
        try:
            while not self._closed:
                if self._run_jobs() and not self._closed:
                    await asyncio.sleep(0)  # what the step woke runs first: its next requests join the next step
                    if self._run_jobs() and not self._closed:
                        self._step()
                    continue
                wake.clear()
                if not self._inbox and not self._closed:
                    await wake.wait()
        except (asyncio.CancelledError, GeneratorExit):  # its loop is ending, or was closed and is gone
            if self._stepper_wake is wake:  # (else a new stepper has taken over already)
                self._stepper = None
                self._hand_over(loop)
            raise
        except BaseException as error:  # never die silently: fail what waits, refuse what comes
            self._dead = error
            log.exception("the engine's stepper stopped")
            self._fail_all(RuntimeError(f"the engine's stepper stopped: {error!r}"))

    def _hand_over(self, ending: asyncio.AbstractEventLoop) -> None:
        """The stepper on `ending` stopped (that loop is ending, or was closed and its tasks destroyed, when
        this may run from the garbage collector: it only reads, and asks another loop to step). Another loop
        that waits on the engine takes the stepping over; requests of the ending loop are aborted when
        their results find it gone."""
        waiting = [pending.loop for pending in list(self._pending.values())] + [
            loop for _, loop in list(self._inbox)]
        for loop in dict.fromkeys(waiting):
            if loop is not ending and _notify(loop, self._restart_stepper):
                break

    def _restart_stepper(self) -> None:
        if not self._closed and not self._wake_stepper():
            self._start_stepper()

    def _queue(self, fn) -> asyncio.Future:
        """Queue `fn` for where the engine steps (between two steps, after the jobs queued before it); its
        result comes in the future."""
        if self._closed or self._dead is not None:
            raise RuntimeError(f"the engine is {'closed' if self._closed else f'stopped: {self._dead!r}'}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def job():
            try:
                result = fn()
            except BaseException as error:  # handed to the awaiting coroutine
                _notify(loop, _resolve, future, None, error)
            else:
                _notify(loop, _resolve, future, result)

        self._submit(job, loop)
        return future

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # never die silently: fail what waits, refuse what comes
            self._dead = error
            log.exception("the engine thread stopped")
            self._fail_all(RuntimeError(f"the engine thread stopped: {error!r}"))

    def _loop(self) -> None:
        while not self._closed:
            if self._run_jobs():
                self._step()
            else:
                self._wake.wait()
                self._wake.clear()
        self._fail_all(RuntimeError("the engine was closed"))

    def _run_jobs(self) -> bool:
        """Run the queued jobs; whether a step is due (not paused or held, requests running)."""
        with self._busy:
            while not self._closed:
                try:
                    job, _ = self._inbox.popleft()
                except IndexError:
                    break
                try:
                    job()
                except Exception:  # queued jobs report their own errors; this is an abort or cleanup
                    log.exception("an engine job failed")
            return (not self._closed and not self._paused and self.version >= self._held_until
                    and self._backend_has_work())

    def _step(self) -> None:
        with self._busy:
            if self._closed:  # `close` ran since the jobs
                return
            try:
                progress = self._backend_step()
            except Exception as error:  # fail every request rather than hang them
                self._fail_all(error)
                return
            outbox: dict[asyncio.AbstractEventLoop, list[tuple]] = {}
            for item in progress:
                self._collect(item, outbox)
            self._deliver(outbox)

    def _collect(self, item: Progress, outbox: dict) -> None:
        """Record a step's tokens for a request; what its caller must hear goes to `outbox`, by event loop."""
        pending = self._pending.get(item.request_id)
        if pending is None:
            return
        calls = outbox.setdefault(pending.loop, [])
        if item.error is not None:
            self._abort([item.request_id])
            calls.append((_resolve, (pending.future, None, ValueError(item.error)), item.request_id))
            return
        pending.token_ids += item.token_ids
        pending.logprobs += item.logprobs
        pending.versions += [self.version] * len(item.token_ids)
        if pending.want_top:
            pending.top_logprobs += item.top_logprobs or [{} for _ in item.token_ids]
        if pending.on_tokens is not None and item.token_ids:
            calls.append((pending.on_tokens, (pending.index, item), item.request_id))
        if item.finished:
            del self._pending[item.request_id]
            sample = Sample(pending.token_ids, pending.logprobs, pending.versions, item.finish_reason,
                            routes=fit_routes(item.routes, pending.prompt_len + len(pending.token_ids)),
                            prompt_len=pending.prompt_len,
                            top_logprobs=pending.top_logprobs if pending.want_top else None)
            calls.append((_resolve, (pending.future, sample), item.request_id))

    def _deliver(self, outbox: dict) -> None:
        """Each event loop's callbacks of a step: at once on the loop that steps, else in one wake-up per
        loop rather than per request (each is a write to the loop's self-pipe). A loop that is gone had
        callers who went away: their requests are aborted."""
        here = _running_loop()
        for loop, calls in outbox.items():
            if loop is here:
                _run_calls(calls)
            elif not _notify(loop, _run_calls, calls):
                self._abort([request_id for *_, request_id in calls])

    def _abort(self, request_ids: list[str]) -> None:
        live = [request_id for request_id in request_ids if self._pending.pop(request_id, None)]
        if live:
            try:
                self._backend_abort(live)
            except Exception:
                log.exception("aborting %d requests failed", len(live))

    def _fail_all(self, error: BaseException) -> None:
        for pending in self._pending.values():
            _notify(pending.loop, _resolve, pending.future, None, error)
        self._abort(list(self._pending))
