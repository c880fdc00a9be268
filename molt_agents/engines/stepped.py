"""The engine thread shared by every backend: async requests in, one step at a time.

A backend implements four methods that run on the engine thread: start a
request, advance all running requests by one step, abort requests, reload
weights. This class owns the rest: coroutines submit work to the thread and
await futures, so no request blocks the event loop; all running requests
advance together in each step, so concurrent requests batch; a pause takes
effect between two steps, and so does a weight update, which is why every
token can be stamped with the exact version of the weights that sampled it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
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


def _notify(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Run `fn(*args)` on `loop`; False if that loop is gone (its caller went away)."""
    try:
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
    """Base of the engines; subclasses implement the four `_backend_*` methods."""

    def __init__(self):
        self.version = 0
        self._pending: dict[str, _Pending] = {}  # touched only on the engine thread
        self._request_ids = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._paused = False
        self._closed = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"molt-{type(self).__name__}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------
    # Backend interface (engine thread)

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

        await self._call(submit)
        try:
            return list(await asyncio.gather(*(future for _, future in requests)))
        except asyncio.CancelledError:
            ids = [request_id for request_id, _ in requests]
            self._submit(lambda: self._abort(ids))
            raise

    async def pause(self) -> None:
        await self._call(lambda: setattr(self, "_paused", True))

    async def resume(self) -> None:
        await self._call(lambda: setattr(self, "_paused", False))

    async def sleep(self) -> None:
        """Release the device memory of the weights and the KV cache (GPU engines); `wake` takes it back."""
        await self._call(self._backend_sleep)

    async def wake(self) -> None:
        await self._call(self._backend_wake)

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
        self._wake.set()
        self._thread.join(timeout=30)
        self._backend_close()

    # ------------------------------------------------------------------
    # Engine thread

    def _submit(self, job) -> None:
        self._inbox.put(job)
        self._wake.set()

    async def _call(self, fn):
        """Run `fn` on the engine thread between two steps and await its result."""
        return await self._queue(fn)

    def _queue(self, fn) -> asyncio.Future:
        """Queue `fn` for the engine thread (between two steps, after the jobs queued before it); its result
        comes in the future."""
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

        self._submit(job)
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
            while True:
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                try:
                    job()
                except Exception:  # `_call` jobs report their own errors; this is an abort or cleanup
                    log.exception("an engine job failed")
            if self._paused or not self._backend_has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                progress = self._backend_step()
            except BaseException as error:  # fail every request rather than hang them
                self._fail_all(error)
                continue
            outbox: dict[asyncio.AbstractEventLoop, list[tuple]] = {}
            for item in progress:
                self._collect(item, outbox)
            self._deliver(outbox)
        self._fail_all(RuntimeError("the engine was closed"))

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
        """Wake each event loop once per step with all of its callbacks (one wake-up per loop rather than
        per request: each is a write to the loop's self-pipe). A loop that is gone had callers who went
        away: their requests are aborted."""
        for loop, calls in outbox.items():
            if not _notify(loop, _run_calls, calls):
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
