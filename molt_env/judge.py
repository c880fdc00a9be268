"""`Judge`: an LLM judge that an environment awaits in its async step.

    from molt_env import Env, Judge

    class Summary(Env):
        judge = Judge("Text: {text}\\nSummary: {answer}\\nRate the summary from 0 to 10; reply with the number.",
                      scale=10)

        async def astep(self, action):
            score = await self.judge(text=self.text, answer=action)
            return "", score, True, False, {"judge": score}

The judge asks any OpenAI-compatible Chat Completions endpoint (a hosted API,
`molt-serve` of a frozen model, a vLLM server) one user message, the rubric
filled with the call's keyword arguments, and reads the score with `parse`
(by default the first number of the reply, from 0 to `scale`, divided by
`scale`). `base_url`, `model` and `api_key` default to the environment
variables MOLT_JUDGE_URL, MOLT_JUDGE_MODEL and MOLT_JUDGE_API_KEY (then
OPENAI_API_KEY), read at the first call in the process that plays the
episodes; a run's Ray workers get the `MOLT_*` variables of its `molt-train`.

`base_url="policy"` (or MOLT_JUDGE_URL=policy) asks the policy being trained,
on the engine of the process that plays the episode (self-judging, as in
self-rewarding language models): the process's rollout worker registers how
to reach it (`serve_policy`), and its loopback serves the judge's requests
on a route that captures nothing, so they are never trained. The policy's
weights move while the cache keeps a score: a request asked again is not
re-judged by later weights.

In each process and event loop the judge keeps at most `max_concurrency`
requests in flight, each within `timeout` seconds. A request that fails (no
connection, an HTTP error, a timeout, a reply `parse` cannot read) is sent
again after `backoff`, then twice that, and so on, up to `retries` more times.
Identical requests are asked once: a score is cached (the last `cache_size`
requests) and a request in flight is awaited, not repeated. A judge that still
fails raises `JudgeError`: the episode is dropped, and counted in the run's
metrics as `episodes/failed/JudgeError`; it never becomes a reward of 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeError(RuntimeError):
    """The judge gave no score after its retries."""


_policy: Callable[[], Awaitable[tuple[str, str, str]]] | None = None


def serve_policy(endpoint: Callable[[], Awaitable[tuple[str, str, str]]] | None) -> None:
    """Register, for this process, how a judge with `base_url="policy"` reaches the policy: `await
    endpoint()` returns its base URL, API key and model name (a rollout worker serves its engine)."""
    global _policy
    _policy = endpoint


def first_number(reply: str, scale: float) -> float:
    """The first number of `reply` divided by `scale`; a `ValueError` when there is none or it is not in
    0..scale."""
    found = NUMBER.search(reply)
    if found is None:
        raise ValueError(f"no number in the judge's reply {reply[:80]!r}")
    number = float(found.group())
    if not 0 <= number <= scale:
        raise ValueError(f"the judge's score {found.group()} is outside 0..{scale:g}")
    return number / scale


@dataclass
class _PerLoop:
    client: object
    slots: asyncio.Semaphore
    model: str
    pending: dict[str, asyncio.Future] = field(default_factory=dict)


class Judge:
    def __init__(self, rubric: str, *, scale: float = 10.0, parse: Callable[[str], float] | None = None,
                 base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 max_tokens: int = 16, temperature: float = 0.0, max_concurrency: int = 16,
                 timeout: float = 60.0, retries: int = 3, backoff: float = 1.0, cache_size: int = 4096):
        """`parse(reply)` turns the judge's reply into a score (raise `ValueError` for a reply it cannot
        read); by default `first_number(reply, scale)`."""
        if retries < 0 or max_concurrency < 1 or timeout <= 0:
            raise ValueError("Judge needs retries >= 0, max_concurrency >= 1 and timeout > 0")
        self.rubric, self.parse = rubric, parse or (lambda reply: first_number(reply, scale))
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.sampling = {"max_tokens": max_tokens, "temperature": temperature}
        self.max_concurrency, self.timeout, self.retries, self.backoff = max_concurrency, timeout, retries, backoff
        self.cache: OrderedDict[str, float] = OrderedDict()
        self.cache_size = cache_size
        self.loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def __call__(self, **fields) -> float:
        """The judge's score of the rubric filled with `fields`."""
        messages = [{"role": "user", "content": self.rubric.format(**fields)}]
        key = json.dumps([messages, self.sampling])
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        loop = await self._loop()
        if key not in loop.pending:
            loop.pending[key] = asyncio.ensure_future(self._ask(loop, messages))
            loop.pending[key].add_done_callback(lambda _: loop.pending.pop(key, None))
        score = await asyncio.shield(loop.pending[key])
        self.cache[key] = score
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return score

    async def _ask(self, loop: _PerLoop, messages: list[dict]) -> float:
        errors = []
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                async with loop.slots:
                    reply = await asyncio.wait_for(loop.client.chat.completions.create(
                        model=loop.model, messages=messages, **self.sampling), self.timeout)
                return self.parse(reply.choices[0].message.content or "")
            except Exception as error:  # noqa: BLE001 (any failure of the request or of its reply is retried)
                errors.append(f"{type(error).__name__}: {error}")
        raise JudgeError(f"no score after {self.retries + 1} tries at {loop.client.base_url}; the last: {errors[-1]}")

    async def _loop(self) -> _PerLoop:
        """The client and the request slots of the running event loop (a client is bound to its loop)."""
        running = asyncio.get_running_loop()
        if running not in self.loops:
            import openai

            base_url = self.base_url or os.environ.get("MOLT_JUDGE_URL")
            if not base_url:
                raise JudgeError("the judge has no endpoint: give Judge(base_url=...) or set MOLT_JUDGE_URL")
            api_key = self.api_key or os.environ.get("MOLT_JUDGE_API_KEY") or os.environ.get("OPENAI_API_KEY", "none")
            model = self.model or os.environ.get("MOLT_JUDGE_MODEL", "judge")
            if base_url == "policy":
                if _policy is None:
                    raise JudgeError("the judge asks the policy, and this process serves none (a run's rollout "
                                     "workers do)")
                base_url, api_key, model = await _policy()
            if running not in self.loops:  # not made by a call that awaited beside this one
                client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout)
                self.loops[running] = _PerLoop(client, asyncio.Semaphore(self.max_concurrency), model)
        return self.loops[running]
