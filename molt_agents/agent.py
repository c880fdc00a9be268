"""`ChatAgent`: bring an existing OpenAI-client program as the policy's agent.

An agent is an ordinary program. It gets an `AgentContext` with a base URL
and an API key for its own loopback session, talks to the policy with the
stock `openai` client (chat, tools, streaming, n > 1: whatever it already
does), and returns the episode's reward. The loopback captures every sampled
token behind its back; no `extra_body`, no special flags.

    class Solver(ChatAgent):
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages)
            _, reward, _, _, _ = ctx.env.step(reply.choices[0].message.content or "")
            return reward

A client made per episode costs its SSL context (20-50 ms on a CPU, more than
an episode of a tiny model): `ctx.client()` is such a client, copied per
episode from one per event loop (`ctx.sync_client()` for blocking code).
Where the loopback runs in the agent's process, as in a rollout worker,
`ctx.client()` hands its requests to the loopback's ASGI app in process:
the same routes, checks and capture, without the sockets, HTTP parsing and
connection pool in between (bench/README.md, "Agentic workload"); and it is
one client for every episode on the loop, each request going to the session
of the episode (the task) that sends it, so no episode pays for a copy and
its first request's platform probe.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from molt_env.trajectory import Trajectory


@dataclass
class AgentContext:
    base_url: str  # http://127.0.0.1:PORT/s/<session>/v1, for openai.OpenAI(base_url=...)
    api_key: str
    model: str
    messages: list[dict]  # the task's prompt
    tools: list[dict] | None = None  # OpenAI function schemas the task offers
    sampling: dict = field(default_factory=dict)  # defaults the loopback applies to unset parameters
    task: dict = field(default_factory=dict)  # task data (e.g. the expected answer) for computing reward
    session_id: str = ""
    env: Any = None  # the task's environment when there is one: `ctx.env.step(answer)` scores an answer
    app: Any = None  # the loopback's ASGI app when it serves this session in this process (`client()` calls it)

    def client(self):
        """An `openai.AsyncOpenAI` on this episode's session. With `app`: one client per event loop for every
        episode of that app, which sends each request to the app in process, on the session of the episode
        that sends it (a streamed reply then arrives whole, once sampled). Without: a copy (`with_options`,
        about 0.05 ms) of one client per event loop, whose connection pool serves every episode on it."""
        import openai

        clients = _ASYNC_CLIENTS.setdefault(asyncio.get_running_loop(), {})
        if self.app is not None:
            if self.app not in clients:
                import httpx2  # the openai client's HTTP library

                transport = httpx2.ASGITransport(_EpisodeSessions(self.app), raise_app_exceptions=False)
                clients[self.app] = openai.AsyncOpenAI(
                    base_url=self.base_url.replace(f"/s/{self.session_id}/", f"/s/{_EPISODE}/"),
                    api_key=self.api_key, http_client=httpx2.AsyncClient(transport=transport))
            return clients[self.app]
        if None not in clients:
            clients[None] = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key)
        return clients[None].with_options(base_url=self.base_url, api_key=self.api_key)

    def sync_client(self):
        """An `openai.OpenAI` on this episode's session, for a blocking `run`: a copy of one per process."""
        import openai

        global _SYNC_CLIENT
        with _SYNC_LOCK:
            if _SYNC_CLIENT is None:
                _SYNC_CLIENT = openai.OpenAI(base_url=self.base_url, api_key=self.api_key)
        return _SYNC_CLIENT.with_options(base_url=self.base_url, api_key=self.api_key)


_ASYNC_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {app or None: client}
_SYNC_CLIENT = None
_SYNC_LOCK = threading.Lock()
_EPISODE = "episode"  # the session in the path of an in-process client's requests: the sending episode's
_SESSION: contextvars.ContextVar[str] = contextvars.ContextVar("molt_loopback_session")  # set by `run_agent`


class _EpisodeSessions:
    """The loopback's ASGI app behind an in-process client that every episode on a loop shares: a request
    for the session `_EPISODE` goes to the session of the episode whose task (or a task it started, or a
    thread it started with `asyncio.to_thread`, which copies its context) sends it."""

    def __init__(self, app):
        self.app, self.prefix = app, f"/s/{_EPISODE}/"

    async def __call__(self, scope, receive, send):
        session = _SESSION.get(None)
        if session is not None and scope["type"] == "http" and scope["path"].startswith(self.prefix):
            path = f"/s/{session}/{scope['path'][len(self.prefix):]}"
            scope = dict(scope, path=path, raw_path=path.encode())
        await self.app(scope, receive, send)


@dataclass
class AgentResult:
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


class ChatAgent:
    """Subclass and implement `run(ctx)` (sync or async), returning a reward or an `AgentResult`."""

    def run(self, ctx: AgentContext) -> float | AgentResult:
        raise NotImplementedError(f"{type(self).__name__} must implement run(ctx)")


async def run_agent(agent: ChatAgent, loopback, *, messages: list[dict], tools: list[dict] | None = None,
                    sampling: dict | None = None, task: dict | None = None, rollout_id: str = "",
                    group_id: str = "", env=None, conversation: list | None = None) -> list[Trajectory]:
    """Run `agent` once in a fresh loopback session; returns the session's segments with the reward.
    `conversation`, a list, receives the session's last chat request and its reply (none after raw
    completions alone)."""
    session = loopback.open_session(rollout_id=rollout_id, group_id=group_id, defaults=sampling)
    ctx = AgentContext(base_url=loopback.base_url(session.id), api_key=loopback.api_key,
                       model=loopback.model_name, messages=list(messages), tools=tools,
                       sampling=dict(sampling or {}), task=dict(task or {}), session_id=session.id, env=env,
                       app=loopback.app)
    episode = _SESSION.set(session.id)  # where `ctx.client()`'s requests go from this task
    try:
        result = await call_agent(agent, ctx)
    except BaseException:
        loopback.discard(session.id)
        raise
    finally:
        _SESSION.reset(episode)
    trajectories = loopback.finish(session.id, result.reward, result.info)
    if conversation is not None:
        conversation[:] = session.chat or []
    return trajectories


async def call_agent(agent: ChatAgent, ctx: AgentContext) -> AgentResult:
    """`agent.run(ctx)` (a blocking one in a worker thread), its result as an `AgentResult`."""
    if inspect.iscoroutinefunction(agent.run):
        result = await agent.run(ctx)
    else:  # a blocking agent (sync openai client) runs in a worker thread
        result = await asyncio.to_thread(agent.run, ctx)
    if isinstance(result, AgentResult):
        return result
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return AgentResult(float(result))
    raise TypeError(f"{type(agent).__name__}.run returned {result!r}; return a reward or an AgentResult")
