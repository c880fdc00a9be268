"""Where a loopback agent's request spends its CPU outside the engine: the stock client, or the loopback.

    .venv/bin/python bench/agent_request.py [--model tiny:agent]

The locker task's two requests of an episode (the prompt with its tool, then
the same with a tool call and its result), 128 episodes at once, as
`environments.agents.LockerAgent` sends them through `AgentContext.client()`
(one `openai` client for every episode, on `httpx2.ASGITransport`). Each
line times one part alone, in milliseconds a request (median of 6 rounds
after 2 warm-up rounds):

- client: the stock `openai.AsyncOpenAI` against an app that answers a
  canned completion and does nothing else;
- transform: the client's own `async_maybe_transform` of the request body;
- loopback: the loopback's app, with an engine stub that answers at once (a
  tool call, then a digit), posted the same bodies by a bare `httpx2` client;
- bare posts: that bare client against the canned app (what the loopback
  line holds besides the app).

The engine's own work is not here (`bench/profile_rollout.py` times it).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time

import httpx2
from openai._utils import async_maybe_transform
from openai.types.chat import completion_create_params
from transformers import AutoTokenizer

import molt_env
from molt_agents.agent import _SESSION as session_var
from molt_agents.agent import AgentContext
from molt_agents.engines.base import Sample
from molt_agents.loopback import Loopback
from molt_agents.tiny import model_dir
from molt_env.spaces import as_messages

EPISODES = 128
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"id": 2}'}}
CANNED = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "policy",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [CALL]},
                 "finish_reason": "tool_calls", "logprobs": None}],
    "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}}).encode()


async def canned_app(scope, receive, send):
    """An ASGI app that reads the request and answers `CANNED`."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": CANNED})


class InstantEngine:
    """Answers a tool call to a prompt without a tool result, else a digit; at once."""

    version = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.call = tokenizer.encode('<tool_call>\n{"name": "lookup", "arguments": {"id": 2}}\n</tool_call>',
                                     add_special_tokens=False) + [tokenizer.eos_token_id]
        self.digit = tokenizer.encode("7", add_special_tokens=False) + [tokenizer.eos_token_id]

    async def generate(self, prompt_ids, params, on_tokens=None, images=None):
        ids = self.digit if "tool_response" in self.tokenizer.decode(prompt_ids[-30:]) else self.call
        return [Sample(list(ids), [-0.1] * len(ids), [0] * len(ids), "stop", prompt_len=len(prompt_ids))]


def per_request(loop, play) -> float:
    """Milliseconds a request of `play()` (a round of `EPISODES` episodes of two requests each)."""
    times = []
    for round_ in range(8):
        started = time.perf_counter()
        loop.run_until_complete(play())
        times.append(time.perf_counter() - started)
        if round_ == 1:
            gc.freeze()  # as a rollout worker does after its first groups
    return sorted(times[2:])[3] / (2 * EPISODES) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:agent")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(model_dir(args.model))
    env = molt_env.make("locker")
    messages = as_messages(env.reset(seed=1)[0])
    tools = env.tools
    turns = [messages, messages + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                                   {"role": "tool", "tool_call_id": "call_1", "content": "4"}]]
    bodies = [{"model": "policy", "messages": turn, "tools": tools} for turn in turns]
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def by_client():
        async def episode(i):
            session_var.set(str(i))  # as `run_agent` does for the agent's task
            client = AgentContext(base_url=f"http://loopback/s/{i}/v1", api_key="key", model="policy", messages=[],
                                  session_id=str(i), app=canned_app).client()
            for body in bodies:
                await client.chat.completions.create(**body)
        await asyncio.gather(*(episode(i) for i in range(EPISODES)))

    async def transforms():
        for _ in range(EPISODES):
            for body in bodies:
                await async_maybe_transform(body, completion_create_params.CompletionCreateParamsNonStreaming)

    loopback = Loopback(InstantEngine(tokenizer), tokenizer, max_model_len=2048, default_max_tokens=32)
    encoded = [json.dumps(body).encode() for body in bodies]

    def bare(app):
        return httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://loopback",
                                  headers={"Authorization": f"Bearer {loopback.api_key}",
                                           "content-type": "application/json"})

    to_loopback, to_canned = bare(loopback.app), bare(canned_app)

    async def by_loopback():
        async def episode(i):
            session = loopback.open_session()
            for body in encoded:
                reply = await to_loopback.post(f"/s/{session.id}/v1/chat/completions", content=body)
                assert reply.status_code == 200, reply.text
            loopback.finish(session.id, 1.0)
        await asyncio.gather(*(episode(i) for i in range(EPISODES)))

    async def by_bare():
        async def episode(i):
            for body in encoded:
                await to_canned.post(f"/s/{i}/v1/chat/completions", content=body)
        await asyncio.gather(*(episode(i) for i in range(EPISODES)))

    for name, play in (("client", by_client), ("transform", transforms), ("loopback", by_loopback),
                       ("bare posts", by_bare)):
        print(f"{name:>10}: {per_request(loop, play):.3f} ms a request")


if __name__ == "__main__":
    main()
