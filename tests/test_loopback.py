"""The loopback over a socket, driven by the real `openai` SDK, on the real vLLM engine.

Every check ends at the captured trajectory: its sampled tokens are the
engine's, with the engine's logprobs, stitched across turns without
re-tokenizing what the policy wrote.
"""

import asyncio
import json

import httpx
import openai
import pytest
import torch
from conftest import memorize, run
from transformers import AutoModelForCausalLM

from molt_agents.agent import AgentResult, ChatAgent, run_agent
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
