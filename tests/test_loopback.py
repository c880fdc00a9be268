"""The loopback over a socket, driven by the real `openai` SDK, on the real vLLM engine.

Every check ends at the captured trajectory: its sampled tokens are the
engine's, with the engine's logprobs, stitched across turns without
re-tokenizing what the policy wrote.
"""

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
import torch
from conftest import memorize, run
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt_agents.agent import AgentResult, ChatAgent, run_agent
from molt_agents.loopback import Loopback
from molt_env.trajectory import check

TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
QUESTION = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 17 * 23?"}]
CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(17 * 23)"}}\n</tool_call>'
TOOL_CONVERSATION = QUESTION + [
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "The answer is 391."},
]


def _client(loopback, session):
    return openai.OpenAI(base_url=loopback.base_url(session), api_key=loopback.api_key, max_retries=0)


def _recompute(model, trajectory):
    """Transformers logprob of every token, given the tokens before it."""
    ids = torch.tensor([trajectory.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logprobs])


def _max_trained_logprob_error(model, trajectory):
    reference = _recompute(model, trajectory)
    errors = [abs(reference[i].item() - lp) for i, (m, lp) in enumerate(zip(trajectory.mask, trajectory.logprobs)) if m]
    assert errors, "no trained tokens"
    return max(errors)


# --------------------------------------------------------------------------
# The wire


def test_sync_chat_completion_is_captured_token_exact(loopback, dense_dir):
    session = loopback.open_session(group_id="g").id
    reply = _client(loopback, session).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "What is 3 + 4?"}], max_tokens=12, seed=5,
        logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    assert reply.usage.completion_tokens == len(choice.logprobs.content) <= 12
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    (trajectory,) = loopback.finish(session, reward=1.0)
    check(trajectory)
    assert trajectory.reward == 1.0 and trajectory.group_id == "g"
    assert trajectory.num_trainable == reply.usage.completion_tokens
    assert len(trajectory.token_ids) == reply.usage.prompt_tokens + reply.usage.completion_tokens
    sampled = [lp for m, lp in zip(trajectory.mask, trajectory.logprobs) if m]
    assert sampled == pytest.approx([entry.logprob for entry in choice.logprobs.content], abs=1e-6)
    assert loopback.captured == [trajectory]
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    assert _max_trained_logprob_error(model, trajectory) < 1e-4


def test_async_streaming_and_models(loopback):
    session = loopback.open_session().id

    async def talk():
        client = openai.AsyncOpenAI(base_url=loopback.base_url(session), api_key=loopback.api_key, max_retries=0)
        models = await client.models.list()
        stream = await client.chat.completions.create(
            model=models.data[0].id, messages=[{"role": "user", "content": "Count to three."}],
            max_completion_tokens=10, stream=True, stream_options={"include_usage": True}, seed=1)
        text, finish, usage, pieces = "", None, None, 0
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                pieces += bool(choice.delta.content)
                finish = choice.finish_reason or finish
        return text, finish, usage, pieces

    text, finish, usage, pieces = run(talk())
    assert pieces > 1, "the reply should arrive token by token, not in one piece"
    (trajectory,) = loopback.finish(session, reward=0.5)
    sampled = [t for t, m in zip(trajectory.token_ids, trajectory.mask) if m]
    assert usage.completion_tokens == len(sampled)
    assert finish in ("stop", "length")
    tokenizer = loopback.tokenizer
    if sampled[-1] == tokenizer.eos_token_id:
        sampled = sampled[:-1]
    assert text == tokenizer.decode(sampled, skip_special_tokens=True)


def test_n_choices_make_one_segment_each(loopback, dense_dir):
    session = loopback.open_session().id
    reply = _client(loopback, session).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "Hello"}], n=3, max_tokens=8, seed=3)
    assert len(reply.choices) == 3
    trajectories = loopback.finish(session, reward=0.25)
    assert len(trajectories) == 3
    assert {t.rollout_id for t in trajectories} == {session}  # one rollout: counted once in baselines
    assert sum(t.num_trainable for t in trajectories) == reply.usage.completion_tokens
    prompts = {tuple(t.token_ids[: t.mask.index(1)]) for t in trajectories}
    assert len(prompts) == 1  # the shared prompt, trained in none of them


def test_completions_endpoint_stitches_text_prompts(loopback):
    session = loopback.open_session().id
    client = _client(loopback, session)
    first = client.completions.create(model="policy", prompt="The answer is", max_tokens=6, seed=2, logprobs=1)
    assert len(first.choices[0].logprobs.token_logprobs) <= 6
    second = client.completions.create(model="policy", prompt="The answer is" + first.choices[0].text + " so",
                                       max_tokens=6, seed=2)
    streamed, third = "", None
    for chunk in client.completions.create(
            model="policy", prompt="The answer is" + first.choices[0].text + " so" + second.choices[0].text,
            max_tokens=6, seed=2, stream=True, stream_options={"include_usage": True}):
        streamed += "".join(choice.text for choice in chunk.choices)
        third = chunk.usage or third
    trajectories = loopback.finish(session, reward=0.0)
    assert len(trajectories) == 1  # each prompt extended the last: one segment
    assert trajectories[0].num_trainable == sum(u.completion_tokens for u in (first.usage, second.usage, third))
    assert loopback.tokenizer.decode(trajectories[0].token_ids, skip_special_tokens=True).endswith(streamed)


def test_sampled_ids_are_kept_when_retokenizing_would_change_them(loopback, dense_dir):
    """Byte-level BPE: encode(decode(ids)) != ids for many sampled sequences; the trajectory keeps ids."""
    tokenizer = loopback.tokenizer
    session = loopback.open_session().id
    client = _client(loopback, session)
    messages = [{"role": "user", "content": "Say something."}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=40, n=4, seed=11)
    trajectories = loopback.finish(session, reward=0.0)
    differing = 0
    for trajectory in trajectories:
        sampled = [t for t, m in zip(trajectory.token_ids, trajectory.mask) if m]
        text = tokenizer.decode(sampled, skip_special_tokens=False)
        if tokenizer.encode(text, add_special_tokens=False) != sampled:
            differing += 1
    assert differing > 0, "expected some sampled sequences that re-tokenize differently"
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    for trajectory in trajectories:  # the engine's logprobs belong to exactly these ids
        assert _max_trained_logprob_error(model, trajectory) < 1e-4
    assert len(reply.choices) == 4


# --------------------------------------------------------------------------
# A multi-turn tool-using session, with a policy that really calls the tool


@pytest.fixture
def tool_policy(loopback, dense_dir):
    state = memorize(dense_dir, [TOOL_CONVERSATION], tools=TOOLS, steps=40)
    run_in = loopback.engine
    run(run_in.update_weights(list(state.items())))
    yield state
    original = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    run(run_in.update_weights(list(original.state_dict().items())))


def test_tool_call_session_is_stitched_and_logprobs_match(loopback, tool_policy, dense_dir):
    session = loopback.open_session().id
    client = _client(loopback, session)
    messages = list(QUESTION)
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=48, seed=0)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "python"
    assert json.loads(call.function.arguments) == {"code": "print(17 * 23)"}

    # The agent runs the tool and sends the call and its result back, as any OpenAI agent does.
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "391"})
    second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=24, seed=0)
    assert "391" in second.choices[0].message.content

    (trajectory,) = loopback.finish(session, reward=1.0)  # one segment: the history extended the first
    check(trajectory)
    assert trajectory.num_trainable == first.usage.completion_tokens + second.usage.completion_tokens
    tokenizer = loopback.tokenizer
    text = tokenizer.decode(trajectory.token_ids)
    assert text.count("<|im_start|>assistant") == 2 and "<tool_response>\n391\n</tool_response>" in text

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    model.load_state_dict(tool_policy)
    error = _max_trained_logprob_error(model, trajectory)
    sampled = [lp for m, lp in zip(trajectory.mask, trajectory.logprobs) if m]
    assert min(sampled) < -1e-4, "a saturated policy (all logprobs 0) would make this comparison vacuous"
    print(f"tool session: max |engine - transformers| logprob over {trajectory.num_trainable} tokens = {error:.2e}")
    assert error < 1e-4


def test_streamed_tool_call(loopback, tool_policy):
    session = loopback.open_session().id
    stream = _client(loopback, session).chat.completions.create(
        model="policy", messages=QUESTION, tools=TOOLS, max_tokens=48, seed=0, stream=True, logprobs=True)
    content, calls, finish, logprobs = "", {}, None, 0
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                calls.setdefault(call.index, call)
            finish = choice.finish_reason or finish
            logprobs += len(choice.logprobs.content) if choice.logprobs else 0
    assert "<tool_call>" not in content and finish == "tool_calls"
    assert calls[0].function.name == "python"
    assert json.loads(calls[0].function.arguments) == {"code": "print(17 * 23)"}
    (trajectory,) = loopback.finish(session, reward=1.0)
    assert logprobs == trajectory.num_trainable


def test_rewritten_history_seals_the_segment(loopback):
    session = loopback.open_session().id
    client = _client(loopback, session)
    messages = [{"role": "user", "content": "First question?"}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, seed=0)
    # The agent compacts its context: the earlier reply is replaced by a summary.
    rewritten = [{"role": "user", "content": "Summary of before."}, {"role": "user", "content": "Next?"}]
    second = client.chat.completions.create(model="policy", messages=rewritten, max_tokens=6, seed=0)
    trajectories = loopback.finish(session, reward=2.0)
    assert len(trajectories) == 2
    assert [t.segment for t in trajectories] == [0, 1] and {t.num_segments for t in trajectories} == {2}
    assert {t.reward for t in trajectories} == {2.0}
    assert [t.num_trainable for t in trajectories] == [first.usage.completion_tokens, second.usage.completion_tokens]


def test_chat_agent_runs_against_the_loopback(loopback):
    class Echo(ChatAgent):
        def run(self, ctx):  # a blocking agent with the sync client
            client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            reply = client.chat.completions.create(model=ctx.model, messages=ctx.messages)
            return AgentResult(reward=float(len(reply.choices[0].message.content or "") > 0), info={"k": 1})

    trajectories = run(run_agent(Echo(), loopback, messages=[{"role": "user", "content": "Hi"}],
                                 sampling={"max_tokens": 5, "seed": 0}, rollout_id="r1", group_id="g1"))
    (trajectory,) = trajectories
    assert trajectory.rollout_id == "r1" and trajectory.info["k"] == 1
    assert trajectory.num_trainable <= 5  # the session's sampling defaults applied


def test_ctx_client_is_served_in_process_with_the_sockets_capture(vllm_engines, dense_dir):
    """`ctx.client()` hands its requests to the loopback's app in process: no server has to listen, and the
    session captures what the same requests over a socket capture (the same seeds: the same tokens and
    logprobs), a streamed reply included."""

    class TwoTurns(ChatAgent):
        def __init__(self, over_socket: bool):
            self.over_socket = over_socket

        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) \
                if self.over_socket else ctx.client()
            messages = list(ctx.messages)
            reply = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=6)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": "And then?"}]
            stream = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=6,
                                                          stream=True)
            streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            return AgentResult(1.0, {"streamed": streamed})

    def play(over_socket: bool):
        return run(run_agent(TwoTurns(over_socket), server, messages=[{"role": "user", "content": "Hi"}],
                             sampling={"seed": 3}))

    server = Loopback(vllm_engines.get(dense_dir), AutoTokenizer.from_pretrained(dense_dir), max_model_len=512)
    in_process = play(over_socket=False)  # the server was never started: nothing listens on its port
    server.start()
    try:
        over_socket = play(over_socket=True)
    finally:
        server.stop()
    for ours, theirs in zip(in_process, over_socket, strict=True):
        check(ours)
        assert ours.token_ids == theirs.token_ids and ours.mask == theirs.mask
        # (the second play's prompts hit the engine's prefix cache: the same logprobs up to float rounding)
        assert all(abs(a - b) < 1e-5 for a, b, m in zip(ours.logprobs, theirs.logprobs, ours.mask) if m)
        assert ours.info["streamed"] == theirs.info["streamed"]
    assert sum(in_process[-1].mask) > 0


def test_ctx_client_is_one_client_that_sends_each_episode_s_requests_to_its_session(loopback, dense_dir):
    """Episodes at once on one loop share `ctx.client()` (no copy, no platform probe per episode), and each
    request reaches the session of the episode that sent it, from a task the agent starts too."""
    clients = []

    class Ask(ChatAgent):
        async def run(self, ctx):
            client = ctx.client()
            clients.append(client)
            await asyncio.sleep(0)  # the other episode's agent runs in between
            ask = client.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=3)
            await asyncio.create_task(ask)
            return 1.0

    async def both():
        return await asyncio.gather(*(run_agent(Ask(), loopback, messages=[{"role": "user", "content": text}],
                                                sampling={"seed": 0}, rollout_id=text)
                                      for text in ("Tell me about apples", "Name three rivers")))

    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    apples, rivers = run(both())
    assert clients[0] is clients[1]
    for (trajectory,), asked, other in ((apples, "apples", "rivers"), (rivers, "rivers", "apples")):
        check(trajectory)
        prompt = tokenizer.decode(trajectory.token_ids[:trajectory.mask.index(1)])
        assert asked in prompt and other not in prompt, prompt


@pytest.mark.parametrize("returned,error", [({"reward": 1}, TypeError), (None, KeyError)])
def test_a_failing_agent_raises_and_its_session_is_closed(loopback, returned, error):
    class Failing(ChatAgent):
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            await client.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=3)
            return returned if returned is not None else ctx.task["answer"]

    with pytest.raises(error):
        run(run_agent(Failing(), loopback, messages=[{"role": "user", "content": "Hi"}], rollout_id="failing"))
    assert not [s for s in loopback.sessions.values() if s.rollout_id == "failing"]  # nothing left open


# --------------------------------------------------------------------------
# Bad input: a 4xx with an OpenAI-style error, never a 500, nothing captured


def _post(loopback, path, body=None, key=None, raw=None, headers=None):
    headers = {"Authorization": f"Bearer {key or loopback.api_key}", **(headers or {})}
    url = f"http://127.0.0.1:{loopback.port}{path}"
    if raw is not None:
        return httpx.post(url, content=raw, headers={**headers, "Content-Type": "application/json"})
    return httpx.post(url, json=body, headers=headers)


@pytest.mark.parametrize("body,status,needle", [
    (None, 400, "not valid JSON"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "context window"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
                                                {"type": "text", "text": "x"}]}]}, 400, "not a vision-language model"),
])
def test_bad_requests_get_a_named_4xx(loopback, body, status, needle):
    session = loopback.open_session().id
    path = f"/s/{session}/v1/chat/completions"
    response = _post(loopback, path, raw=b"{not json") if body is None else _post(loopback, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]
    assert loopback.finish(session, reward=0.0) == []  # nothing was captured


def test_auth_unknown_session_and_oversized_body(loopback):
    session = loopback.open_session().id
    ok = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert _post(loopback, f"/s/{session}/v1/chat/completions", ok, key="wrong").status_code == 401
    assert httpx.get(f"http://127.0.0.1:{loopback.port}/s/{session}/v1/models").status_code == 401
    missing = _post(loopback, "/s/nope/v1/chat/completions", ok)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
    huge = _post(loopback, f"/s/{session}/v1/chat/completions", raw=b"{" + b" " * (9 << 20) + b"}")
    assert huge.status_code == 413
    assert _post(loopback, f"/s/{session}/finish", {"reward": "high"}).status_code == 400
    assert _post(loopback, f"/s/{session}/v1/chat/completions", ok).status_code == 200  # still serving
    assert _post(loopback, f"/s/{session}/finish", {"reward": 1}).json()["segments"] == 1
    assert _post(loopback, f"/s/{session}/finish", {"reward": 1}).status_code == 404  # already finished


def test_client_disconnecting_mid_stream_leaves_the_server_whole(loopback):
    session = loopback.open_session().id
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 400, "stream": True, "n": 2}
    headers = {"Authorization": f"Bearer {loopback.api_key}"}
    with httpx.stream("POST", f"http://127.0.0.1:{loopback.port}/s/{session}/v1/chat/completions",
                      json=body, headers=headers) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # read one event, then hang up
    ok = {"messages": [{"role": "user", "content": "y"}], "max_tokens": 3}
    assert _post(loopback, f"/s/{session}/v1/chat/completions", ok).status_code == 200
    trajectories = loopback.finish(session, reward=0.0)
    assert len(trajectories) == 1  # the abandoned reply was not captured
    check(trajectories[0])


def test_concurrent_sessions_batch_in_the_engine(loopback):
    async def one(i):
        session = loopback.open_session().id
        client = openai.AsyncOpenAI(base_url=loopback.base_url(session), api_key=loopback.api_key, max_retries=0)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"{i}"}],
                                             max_tokens=8, seed=i)
        return session

    async def many():
        return await asyncio.gather(*(one(i) for i in range(8)))

    sessions = run(many())
    for session in sessions:
        (trajectory,) = loopback.finish(session, reward=0.0)
        check(trajectory)


def test_a_failed_request_leaves_the_session_as_it_was(loopback):
    session = loopback.open_session().id
    client = _client(loopback, session)
    messages = [{"role": "user", "content": "First?"}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=5, seed=0)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.chat.completions.create(model="policy", messages=messages + [{"role": "user", "content": "x" * 5000}])
    second = client.chat.completions.create(model="policy", messages=messages + [{"role": "user", "content": "Next?"}],
                                            max_tokens=5, seed=0)
    (trajectory,) = loopback.finish(session, reward=1.0)  # still one stitched segment
    assert trajectory.num_trainable == first.usage.completion_tokens + second.usage.completion_tokens
    assert "x" * 100 not in loopback.tokenizer.decode(trajectory.token_ids)


# --------------------------------------------------------------------------
# Nothing lost: bad input is a 400 that leaves the session open, and the connection too


def _chat(content="x", **extra):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "seed": 0, **extra}


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_finish_validates_its_body_before_touching_the_session(loopback):
    session = loopback.open_session().id
    assert _post(loopback, f"/s/{session}/v1/chat/completions", _chat()).status_code == 200
    path = f"/s/{session}/finish"
    for body, param in [({"reward": 1, "info": "x"}, "info"), ({"reward": True}, "reward"),
                        ({"reward": "1"}, "reward"), ({}, "reward"), ({"reward": 1, "infos": {}}, "infos"),
                        ({"reward": 10**400}, "reward"), ([1], None)]:
        response = _post(loopback, path, raw=json.dumps(body).encode())
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, body
    for literal in (b"NaN", b"Infinity", b"-Infinity"):  # not JSON, though Python's json reads them
        response = _post(loopback, path, raw=b'{"reward": ' + literal + b"}")
        assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert loopback.captured == []
    done = _post(loopback, path, {"reward": 0.5, "info": {"k": [1], "session": "spoofed"}})
    assert done.status_code == 200 and done.json()["segments"] == 1
    (trajectory,) = loopback.captured
    assert trajectory.reward == 0.5 and trajectory.info == {"k": [1], "session": session}
    assert _post(loopback, path, {"reward": 0.5}).status_code == 404 and len(loopback.captured) == 1


@pytest.mark.parametrize("route,body,param", [
    ("chat/completions", _chat(seed=2**70), "seed"),  # vLLM: "Overflow when unpacking long long"
    ("chat/completions", _chat(seed=-(2**63) - 1), "seed"),
    ("chat/completions", _chat(top_k=2**70), "top_k"),
    ("chat/completions", _chat(n=2**70), "n"),
    ("chat/completions", _chat(logprobs=True, top_logprobs=2**70), "top_logprobs"),
    ("chat/completions", _chat(temperature=2.5), "temperature"),  # vLLM samples at temperature <= 2
    ("chat/completions", _chat(stop=["a", ""]), "stop"),  # vLLM refuses an empty stop string
    ("completions", {"prompt": "x", "max_tokens": 2, "logprobs": 2**70}, "logprobs"),
    ("completions", {"prompt": "x", "max_tokens": 2, "seed": 2**64}, "seed"),
    ("completions", {"prompt": [1, 2**70], "max_tokens": 2}, "prompt"),
])
def test_values_beyond_the_engine_get_a_400_naming_the_field(loopback, route, body, param):
    session = loopback.open_session().id
    response = _post(loopback, f"/s/{session}/v1/{route}", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    ok = _chat() if route == "chat/completions" else {"prompt": "x", "max_tokens": 2}
    assert _post(loopback, f"/s/{session}/v1/{route}", ok).status_code == 200
    assert len(loopback.finish(session, reward=0.0)) == 1  # the bad request left no trace


def test_integers_at_the_engine_bounds_are_served(loopback):
    session = loopback.open_session().id
    for extra in ({"seed": 2**63 - 1, "n": 3}, {"seed": -(2**63)}, {"top_k": 2**31 - 1}):
        response = _post(loopback, f"/s/{session}/v1/chat/completions", {**_chat(), **extra})
        assert response.status_code == 200, (extra, response.text)
    # Any max_tokens is capped at the room left in the context (a long prompt keeps that room small).
    response = _post(loopback, f"/s/{session}/v1/chat/completions", {**_chat(" x" * 490), "max_tokens": 2**70})
    usage = response.json()["usage"]
    assert response.status_code == 200 and usage["total_tokens"] <= loopback.max_model_len, response.text


def test_nesting_is_bounded(loopback):
    session = loopback.open_session().id
    path = f"/s/{session}/v1/chat/completions"
    body = json.dumps(_chat()).encode()[:-1]
    # The body object is level 1: "metadata" (ignored by the loopback) adds the rest.
    assert _post(loopback, path, raw=body + b', "metadata": ' + _nested(63) + b"}").status_code == 200
    for depth in (64, 5_000, 500_000):  # the last one overflowed Python's JSON parser (RecursionError)
        response = _post(loopback, path, raw=body + b', "metadata": ' + _nested(depth) + b"}")
        assert response.status_code == 400, (depth, response.text)
        assert "nested more than 64 levels" in response.json()["error"]["message"]
    lone = _post(loopback, path, raw=json.dumps(_chat("\ud800")).encode())  # a lone UTF-16 surrogate
    assert lone.status_code == 400 and "surrogate" in lone.json()["error"]["message"], lone.text
    assert len(loopback.finish(session, reward=0.0)) == 1


def test_bad_requests_keep_the_connection_alive(loopback):
    session = loopback.open_session().id
    base = f"http://127.0.0.1:{loopback.port}/s/{session}"
    bad = [("/v1/chat/completions", json.dumps(_chat(seed=2**70)).encode()),
           ("/v1/chat/completions", _nested(100_000)),
           ("/finish", json.dumps({"reward": 1, "info": "x"}).encode())]  # after a sampled turn
    with httpx.Client(headers={"Authorization": f"Bearer {loopback.api_key}"}) as client:
        responses = []
        for path, raw in bad:
            responses.append(client.post(base + path, content=raw))
            responses.append(client.post(base + "/v1/chat/completions", json=_chat()))
        ports = [r.extensions["network_stream"].get_extra_info("client_addr")[1] for r in responses]
        finished = client.post(base + "/finish", json={"reward": 1.0})
    assert len(set(ports)) == 1, f"the client had to reconnect: local ports {ports}"
    assert [r.status_code for r in responses] == [400, 200] * 3, [r.text for r in responses]
    assert finished.json()["segments"] == 3


def _read_reply(connection: socket.socket) -> bytes:
    """One HTTP/1.1 reply with a Content-Length from `connection`; what came if it closed first."""
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = connection.recv(1 << 16)
        if not chunk:
            return reply
        reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += connection.recv(1 << 16)
    return reply


def test_an_idle_connection_outlives_the_clients_keep_alive(loopback):
    """A client may reuse a connection it kept idle for longer than uvicorn's default keep-alive (5 s): the
    server must not have closed it, or a request sent as it closes reads a closed connection (ReadError)."""
    from molt_agents.loopback.server import KEEP_ALIVE_S

    assert KEEP_ALIVE_S > 15  # httpx and the openai SDK keep idle connections 5 s, aiohttp 15 s
    session = loopback.open_session().id
    request = (f"GET /s/{session}/v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Authorization: Bearer {loopback.api_key}\r\n\r\n").encode()
    replies = []
    with socket.create_connection(("127.0.0.1", loopback.port), timeout=30) as connection:
        for pause in (0, 6):  # the second request on the same connection after an idle gap past 5 s
            time.sleep(pause)
            connection.sendall(request)
            replies.append(_read_reply(connection))
    assert replies[0].startswith(b"HTTP/1.1 200"), replies[0]
    assert replies[1].startswith(b"HTTP/1.1 200"), f"the server closed the idle connection: {replies[1]!r}"


def test_an_unexpected_error_is_a_json_500_that_keeps_session_and_connection(vllm_engines, dense_dir, caplog):
    """A failing `on_finish` (say, a full disk under molt-serve) stands for any bug behind a route."""
    delivered, failures = [], [RuntimeError("disk full")]

    def on_finish(trajectories):
        if failures:
            raise failures.pop()
        delivered.extend(trajectories)

    server = Loopback(vllm_engines.get(dense_dir), AutoTokenizer.from_pretrained(dense_dir), max_model_len=512,
                      on_finish=on_finish).start()
    try:
        session = server.open_session().id
        base = f"http://127.0.0.1:{server.port}/s/{session}"
        with httpx.Client(headers={"Authorization": f"Bearer {server.api_key}"}) as client:
            assert client.post(base + "/v1/chat/completions", json=_chat()).status_code == 200
            failed = client.post(base + "/finish", json={"reward": 1.0})
            retried = client.post(base + "/finish", json={"reward": 1.0})
            ports = [r.extensions["network_stream"].get_extra_info("client_addr")[1] for r in (failed, retried)]
        assert ports[0] == ports[1], "the 500 closed the client's keep-alive connection"
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "server_error", failed.text
        assert retried.status_code == 200 and retried.json()["segments"] == 1  # the session was kept
        assert len(delivered) == 1
        (record,) = [r for r in caplog.records if r.name == "molt.loopback"]
        assert record.exc_info and "disk full" in str(record.exc_info[1])
    finally:
        server.stop()


def test_a_conversation_the_chat_template_refuses_is_a_400(vllm_engines, dense_dir):
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    # A template that refuses conversations, as Llama 2's and Mistral's do when roles do not alternate.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if not loop.first and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
        "{% endfor %}assistant: ")
    server = Loopback(vllm_engines.get(dense_dir), tokenizer, max_model_len=512).start()
    try:
        session = server.open_session().id
        refused = _post(server, f"/s/{session}/v1/chat/completions",
                        {**_chat(), "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
        assert refused.status_code == 400 and "roles must alternate" in refused.json()["error"]["message"]
        assert _post(server, f"/s/{session}/v1/chat/completions", _chat()).status_code == 200
        assert len(server.finish(session, reward=0.0)) == 1
    finally:
        server.stop()


def test_64_sessions_at_once_each_reach_on_finish_exactly_once(loopback):
    sessions = [loopback.open_session().id for _ in range(64)]
    headers = {"Authorization": f"Bearer {loopback.api_key}"}

    async def one(http, i, session):
        client = openai.AsyncOpenAI(base_url=loopback.base_url(session), api_key=loopback.api_key,
                                    max_retries=0, http_client=http)
        messages, sampled = [{"role": "user", "content": f"Count from {i}."}], 0
        for _ in range(1 + i % 2):  # half the sessions take a second turn
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3, seed=i)
            sampled += reply.usage.completion_tokens
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        finished = await http.post(f"http://127.0.0.1:{loopback.port}/s/{session}/finish",
                                   json={"reward": float(i)}, headers=headers)
        assert finished.status_code == 200, finished.text
        return finished.json()["segments"], sampled

    async def everyone():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, i, s) for i, s in enumerate(sessions)))

    results = run(everyone())
    by_session = {}
    for trajectory in loopback.captured:
        by_session.setdefault(trajectory.info["session"], []).append(trajectory)
    assert sorted(by_session) == sorted(sessions)
    for i, (session, (segments, sampled)) in enumerate(zip(sessions, results)):
        trajectories = by_session[session]
        assert len(trajectories) == segments >= 1  # delivered once: no duplicate segments
        assert sum(t.num_trainable for t in trajectories) == sampled  # every sampled token, none twice
        assert {t.reward for t in trajectories} == {float(i)}
        for trajectory in trajectories:
            check(trajectory)
    delivered = len(loopback.captured)
    again = _post(loopback, f"/s/{sessions[0]}/finish", {"reward": 1.0})
    assert again.status_code == 404 and len(loopback.captured) == delivered
    print(f"64 concurrent sessions: {sum(1 + i % 2 for i in range(64))} chat turns, {delivered} segments "
          f"delivered, {sum(sampled for _, sampled in results)} sampled tokens, each session once")
