"""vLLM as an in-process async engine, driven step by step from one thread.

vLLM's `AsyncLLM` always runs its core in a child process (about 11 s to
start on CPU and a `__main__` guard in every script). Instead this wraps the
in-process `LLMEngine` (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, about 2 s) and
drives `step()` from a dedicated thread; coroutines submit work to that
thread and await futures. Owning the step loop gives exact control where RL
needs it: a pause takes effect between two steps, a weight update lands
between two steps, and every token is stamped with the version of the
weights that were loaded when its step ran.

Logprobs are vLLM's `processed_logprobs`: the logprob of the sampled token
under the distribution it was sampled from (after temperature, top-k/top-p),
which is what importance weights need.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from molt_agents.engines.base import Sample, SamplingParams


def _configure_vllm_env() -> None:
    # Read by vLLM when the engine is built; an explicit user setting wins.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU default takes far more
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_top_logprobs: int = 0
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # the awaiting coroutine was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class VLLMEngine:
    """An `Engine` over vLLM's in-process `LLMEngine`.

    `engine_args` go to `vllm.EngineArgs` unchanged (e.g. `gpu_memory_utilization`,
    `tensor_parallel_size`), overriding the defaults chosen here.
    """

    def __init__(self, model: str | Path, *, dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 4096, **engine_args):
        _configure_vllm_env()
        import torch
        from vllm import EngineArgs, LLMEngine

        args = dict(
            model=str(model),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            distributed_executor_backend="uni",
            enforce_eager=not torch.cuda.is_available(),
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
        )
        args.update(engine_args)
        self._engine = LLMEngine.from_engine_args(EngineArgs(**args))
        self.version = 0
        self._pending: dict[str, _Pending] = {}  # touched only on the engine thread
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._paused = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="molt-vllm-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------
    # Public async interface

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        loop = asyncio.get_running_loop()
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        requests = []
        for i in range(params.n):
            vllm_params = VllmParams(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k or -1,
                max_tokens=params.max_tokens,
                stop=list(params.stop) or None,
                stop_token_ids=list(params.stop_token_ids) or None,
                seed=None if params.seed is None else params.seed + i,
                logprobs=params.top_logprobs,
                output_kind=RequestOutputKind.DELTA,
            )
            requests.append((uuid.uuid4().hex, vllm_params, loop.create_future()))

        def submit():
            for request_id, vllm_params, future in requests:
                self._engine.add_request(request_id, prompt, vllm_params)
                self._pending[request_id] = _Pending(loop, future, len(prompt_ids),
                                                     num_top_logprobs=params.top_logprobs)

        await self._call(submit)
        try:
            return list(await asyncio.gather(*(future for _, _, future in requests)))
        except asyncio.CancelledError:
            ids = [request_id for request_id, _, _ in requests]
            self._submit(lambda: self._abort(ids))
            raise

    async def pause(self) -> None:
        await self._call(lambda: setattr(self, "_paused", True))

    async def resume(self) -> None:
        await self._call(lambda: setattr(self, "_paused", False))

    async def update_weights(self, named_tensors) -> int:
        """Reload weights in place from `(hf_name, tensor)` pairs; returns the new version.

        Runs between two engine steps: tokens sampled after it carry the new version.
        """

        def load():
            self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
            self._engine.reset_prefix_cache()  # cached KV was computed by the old weights
            self.version += 1
            return self.version

        return await self._call(load)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._engine.engine_core.shutdown()

    # ------------------------------------------------------------------
    # Engine thread

    def _submit(self, job) -> None:
        self._inbox.put(job)
        self._wake.set()

    async def _call(self, fn):
        """Run `fn` on the engine thread between two steps and await its result."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def job():
            try:
                result = fn()
            except BaseException as error:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(_resolve, future, None, error)
            else:
                loop.call_soon_threadsafe(_resolve, future, result)

        self._submit(job)
        return await future

    def _run(self) -> None:
        while not self._closed:
            while True:
                try:
                    self._inbox.get_nowait()()
                except queue.Empty:
                    break
            if self._paused or not self._engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self._engine.step()
            except BaseException as error:  # fail every request rather than hang them
                self._fail_all(error)
                continue
            for output in outputs:
                self._collect(output)
        self._fail_all(RuntimeError("the engine was closed"))

    def _collect(self, output) -> None:
        pending = self._pending.get(output.request_id)
        if pending is None:
            return
        completion = output.outputs[0]
        new_ids = list(completion.token_ids)
        pending.token_ids += new_ids
        pending.logprobs += [entry[token].logprob for token, entry in zip(new_ids, completion.logprobs)]
        pending.versions += [self.version] * len(new_ids)
        if pending.num_top_logprobs:  # vLLM adds the sampled token to the top k; ranks start at 1
            pending.top_logprobs += [{t: lp.logprob for t, lp in entry.items() if lp.rank <= pending.num_top_logprobs}
                                     for entry in completion.logprobs]
        if output.finished:
            del self._pending[output.request_id]
            finish_reason = "length" if completion.finish_reason == "length" else "stop"
            sample = Sample(pending.token_ids, pending.logprobs, pending.versions, finish_reason,
                            prompt_len=pending.prompt_len,
                            top_logprobs=pending.top_logprobs if pending.num_top_logprobs else None)
            pending.loop.call_soon_threadsafe(_resolve, pending.future, sample)

    def _abort(self, request_ids: list[str]) -> None:
        live = [request_id for request_id in request_ids if self._pending.pop(request_id, None)]
        if live:
            self._engine.abort_request(live)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, pending in list(self._pending.items()):
            pending.loop.call_soon_threadsafe(_resolve, pending.future, None, error)
        self._abort(list(self._pending))
