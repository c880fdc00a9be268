"""The loopback's Messages API (`client.messages.create` / `.stream`), driven by the real `anthropic` SDK on the
real vLLM engine.

The route is a translation onto the chat route, so the checks are the chat
route's: the captured sampled tokens carry the engine's logprobs (equal to an
independent transformers forward), and a tool episode played through the
Messages API leaves the trajectory that Chat Completions leaves, token for token.
Extended thinking is checked on a policy fine-tuned to reason in the tiny
template's `<think>` format: its reasoning comes back as a thinking block, and
sent back, stitches onto the sampled tokens.
"""

import anthropic
import httpx
import pytest
import torch
from conftest import memorize, run
from test_loopback import QUESTION, TOOLS, _max_trained_logprob_error, _post, tool_policy  # noqa: F401
from test_loopback_responses import _chat_episode
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt_agents.chat_template import ReasoningFormat, reasoning_format, render_text
from molt_agents.loopback import Loopback
from molt_agents.loopback.anthropic import stop_sequence
from molt_env.trajectory import check

# The chat tools of test_loopback in Anthropic's shape.
ANTHROPIC_TOOLS = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                   for f in (tool["function"] for tool in TOOLS)]
SYSTEM, ASK = QUESTION[0]["content"], QUESTION[1]["content"]


def _client(loopback, session):
    """The anthropic SDK appends /v1/messages to its base URL: the session's URL without /v1."""
    return anthropic.Anthropic(base_url=loopback.base_url(session).removesuffix("/v1"), api_key=loopback.api_key,
                               max_retries=0)


def test_text_replies_streamed_and_not_are_captured_token_exact(loopback, dense_dir):
    session = loopback.open_session(defaults={"seed": 3}).id
    client = _client(loopback, session)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    counted = client.messages.count_tokens(model="policy", system="Be brief.", messages=messages)
    first = client.messages.create(model="policy", system="Be brief.", messages=messages, max_tokens=12,
                                   extra_body={"temperature": 1.0, "top_p": 1.0})  # no longer keywords of the SDK
    assert first.usage.input_tokens == counted.input_tokens
    assert first.stop_reason in ("end_turn", "max_tokens") and first.content[0].type == "text"
    messages += [{"role": "assistant", "content": first.content[0].text},
                 {"role": "user", "content": [{"type": "text", "text": "Go on."}]}]
    with client.messages.stream(model="policy", system=[{"type": "text", "text": "Be brief."}], messages=messages,
                                max_tokens=12) as stream:
        events, streamed = [], ""
        for event in stream:
            events.append(event.type)
            streamed += event.text if event.type == "text" else ""
        second = stream.get_final_message()
    assert events[:2] == ["message_start", "content_block_start"] and events[-1] == "message_stop"
    assert events.count("text") > 1, "the reply should arrive token by token"
    assert "message_delta" in events and second.usage.input_tokens > 0
    assert streamed == second.content[0].text

    trajectories = loopback.finish(session, reward=1.0)
    for trajectory in trajectories:
        check(trajectory)
    assert sum(t.num_trainable for t in trajectories) == first.usage.output_tokens + second.usage.output_tokens
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    error = max(_max_trained_logprob_error(model, trajectory) for trajectory in trajectories)
    print(f"anthropic text: max |engine - transformers| logprob over "
          f"{sum(t.num_trainable for t in trajectories)} tokens = {error:.2e}")
    assert error < 1e-5


def _messages_episode(loopback, stream_first: bool):
    session = loopback.open_session(defaults={"seed": 0}).id
    client = _client(loopback, session)
    messages = [{"role": "user", "content": ASK}]
    request = {"model": "policy", "system": SYSTEM, "tools": ANTHROPIC_TOOLS}
    if stream_first:
        with client.messages.stream(messages=messages, max_tokens=48, **request) as stream:
            deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
            first = stream.get_final_message()
        assert "input_json_delta" in deltas
    else:
        first = client.messages.create(messages=messages, max_tokens=48, **request)
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "python" and call.input == {"code": "print(17 * 23)"}
    messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "391"}]}]
    second = client.messages.create(messages=messages, max_tokens=24, **request)
    assert "391" in second.content[0].text
    return loopback.finish(session, reward=1.0)


def test_tool_episode_is_the_chat_completions_trajectory(loopback, tool_policy, dense_dir):  # noqa: F811
    (chat,) = _chat_episode(loopback)
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    model.load_state_dict(tool_policy)
    for stream_first in (False, True):
        (trajectory,) = _messages_episode(loopback, stream_first)  # one segment: the second turn extended the first
        check(trajectory)
        assert trajectory.token_ids == chat.token_ids, stream_first
        assert trajectory.mask == chat.mask and trajectory.versions == chat.versions
        sampled = [lp for m, lp in zip(trajectory.mask, trajectory.logprobs) if m]
        assert sampled == pytest.approx([lp for m, lp in zip(chat.mask, chat.logprobs) if m], abs=1e-6)
        error = _max_trained_logprob_error(model, trajectory)
        print(f"anthropic tool episode (stream_first={stream_first}): {len(trajectory.token_ids)} tokens equal to "
              f"the chat episode's, max |engine - transformers| logprob over {trajectory.num_trainable} sampled "
              f"= {error:.2e}")
        assert error < 1e-5


ASK_BODY = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
     "messages[0].content[0].source"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "python"}]}]},
     "messages[0].content[0].input"),
    ({"system": [{"type": "image"}]}, "system"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),  # not below max_tokens
    ({"thinking": {"type": "enabled", "budget_tokens": 1023}, "max_tokens": 2048}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled"}, "max_tokens": 2048}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, "thinking.display"),
    ({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                     {"type": "thinking", "thinking": "b", "signature": "s"}]}]},
     "messages[0].content[1]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "python"}]}, "tools[0]"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": 5}, "top_k"),
])
def test_bad_requests_get_a_400_in_anthropics_shape_naming_the_field(loopback, extra, param):
    session = loopback.open_session().id
    body = {k: v for k, v in {**ASK_BODY, **extra}.items() if v is not None}
    response = _post(loopback, f"/s/{session}/v1/messages", body)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error", payload
    assert param in payload["error"]["message"], payload
    assert loopback.finish(session, reward=0.0) == []  # nothing was captured


def test_x_api_key_is_accepted_and_errors_keep_anthropics_shape(loopback):
    session = loopback.open_session().id
    url = f"http://127.0.0.1:{loopback.port}/s/{session}/v1/messages/count_tokens"
    body = {"model": "policy", "messages": ASK_BODY["messages"]}  # count_tokens takes no max_tokens
    counted = httpx.post(url, json=body, headers={"x-api-key": loopback.api_key})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0, counted.text
    wrong = httpx.post(url, json=body, headers={"x-api-key": "wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        _client(loopback, "no-such-session").messages.create(model="policy", max_tokens=2, messages=[
            {"role": "user", "content": "x"}])
    loopback.finish(session, reward=0.0)


@pytest.mark.parametrize("text,stop,expected", [
    ("a b END c STOP", ["STOP", "END"], "END"), ("no stop here", ["END"], None), ("x", [], None)])
def test_the_stop_sequence_is_the_earliest_found(text, stop, expected):
    assert stop_sequence(text, stop) == expected


# --------------------------------------------------------------------------
# Extended thinking

THOUGHT, ANSWER = "17 * 23 = 17 * 20 + 17 * 3 = 340 + 51.", "The answer is 391."
REASONED = "<think>\n" + THOUGHT + "\n</think>\n\n" + ANSWER  # the reply as the tiny template writes it


def _without_reasoning(tokenizer):
    """The tiny tokenizer with a chat template that never writes `reasoning_content`."""
    tokenizer.chat_template = tokenizer.chat_template.replace("message.reasoning_content", "none")
    return tokenizer


def test_the_reasoning_format_is_read_off_the_chat_template_and_split_inverts_it(dense_dir):
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    fmt = reasoning_format(tokenizer)
    assert fmt == ReasoningFormat("<think>\n", "\n</think>\n\n")
    assert reasoning_format(_without_reasoning(AutoTokenizer.from_pretrained(dense_dir))) is None

    ask = [{"role": "user", "content": ASK}]
    prompt = render_text(tokenizer, ask)
    ended = "<|im_end|>\n"
    for reply, expected, rendered in [
        (REASONED, (THOUGHT, ANSWER), REASONED + ended),
        ("<think>\n" + THOUGHT, (THOUGHT, ""), REASONED.removesuffix(ANSWER) + ended),  # cut short: closed after
        ("<think>" + THOUGHT + "</think>" + ANSWER, None, None),  # not the template's spacing: text
        ("<think>\n\n</think>\n\n" + ANSWER, None, None),  # empty reasoning: text
        (ANSWER, None, None),
    ]:
        reasoning, rest = fmt.split(reply)
        assert (reasoning, rest) == (expected or (None, reply)), reply
        message = {"role": "assistant", "content": rest}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        # The turn sent back re-renders as sampled, so the next request stitches onto the sampled tokens.
        expected_text = prompt + (rendered or reply + ended)
        assert render_text(tokenizer, [*ask, message], add_generation_prompt=False) == expected_text, reply


@pytest.fixture
def thinking_policy(loopback, dense_dir):
    """The tiny model fine-tuned to answer ASK by reasoning in `<think>` first, loaded into the engine."""
    state = memorize(dense_dir, [[{"role": "user", "content": ASK},
                                  {"role": "assistant", "reasoning_content": THOUGHT, "content": ANSWER}]], steps=40)
    run(loopback.engine.update_weights(list(state.items())))
    yield state
    original = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    run(loopback.engine.update_weights(list(original.state_dict().items())))


def _thinking_episode(loopback, stream_first: bool):
    """Ask with thinking on (streamed or not), send the thinking block back, ask again; returns both replies
    and the session's trajectories."""
    session = loopback.open_session(defaults={"seed": 0}).id
    client = _client(loopback, session)
    messages = [{"role": "user", "content": ASK}]
    if stream_first:  # adaptive: the policy decides whether to reason; no budget to set
        with client.messages.stream(model="policy", messages=messages, max_tokens=64,
                                    thinking={"type": "adaptive"}) as stream:
            starts, deltas = [], []
            for event in stream:
                if event.type == "content_block_start":
                    starts.append(event.content_block.type)
                elif event.type == "content_block_delta":
                    deltas.append(event.delta.type)
            first = stream.get_final_message()
        signed = deltas.index("signature_delta")  # the thinking deltas, its signature, then the text deltas
        assert starts == ["thinking", "text"] and signed > 1, (starts, deltas)
        assert set(deltas[:signed]) == {"thinking_delta"} and set(deltas[signed + 1:]) == {"text_delta"}, deltas
    else:
        first = client.messages.create(model="policy", messages=messages, max_tokens=1100,
                                       thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in first.content] == ["thinking", "text"], first.content
    assert first.content[0].thinking == THOUGHT and first.content[0].signature
    assert first.content[1].text == ANSWER and first.stop_reason == "end_turn"
    # The agent sends the blocks back as they came, as Anthropic asks; thinking need not be on to do so.
    messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                 {"role": "user", "content": "Go on."}]
    second = client.messages.create(model="policy", messages=messages, max_tokens=8)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    return first, second, loopback.finish(session, reward=1.0)


def test_thinking_blocks_carry_the_sampled_reasoning_and_stitch_token_exact(loopback, thinking_policy, dense_dir):
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    model.load_state_dict(thinking_policy)
    tokenizer = loopback.tokenizer
    episodes = []
    for stream_first in (False, True):
        first, second, trajectories = _thinking_episode(loopback, stream_first)
        (trajectory,) = trajectories  # one segment: the second request extended the first reply's tokens
        check(trajectory)
        assert trajectory.num_trainable == first.usage.output_tokens + second.usage.output_tokens
        start = trajectory.mask.index(1)
        reply_ids = trajectory.token_ids[start: start + first.usage.output_tokens]
        assert all(trajectory.mask[start: start + len(reply_ids)])
        assert tokenizer.decode(reply_ids) == REASONED + "<|im_end|>"  # the reasoning tokens are trained as sampled
        error = _max_trained_logprob_error(model, trajectory)
        print(f"anthropic thinking (stream_first={stream_first}): {trajectory.num_trainable} sampled tokens, "
              f"max |engine - transformers| logprob = {error:.2e}")
        assert error < 1e-5
        episodes.append(trajectory.token_ids[: start + len(reply_ids)])
    assert episodes[0] == episodes[1]

    # Without thinking on, the same reply is one text block, markup and all.
    session = loopback.open_session(defaults={"seed": 0}).id
    reply = _client(loopback, session).messages.create(model="policy", messages=[{"role": "user", "content": ASK}],
                                                        max_tokens=64)
    assert [(block.type, block.text) for block in reply.content] == [("text", REASONED)]
    loopback.finish(session, reward=0.0)


def test_without_a_reasoning_format_thinking_is_refused(vllm_engines, dense_dir):
    tokenizer = _without_reasoning(AutoTokenizer.from_pretrained(dense_dir))
    server = Loopback(vllm_engines.get(dense_dir), tokenizer, max_model_len=512).start()
    try:
        session = server.open_session().id
        thinking = {"type": "enabled", "budget_tokens": 1024}
        thought = {"role": "assistant", "content": [{"type": "thinking", "thinking": "b", "signature": "s"}]}
        for path, body, param in [("messages", {**ASK_BODY, "thinking": thinking, "max_tokens": 2048}, "thinking"),
                                  ("messages/count_tokens", {"messages": ASK_BODY["messages"], "thinking": thinking},
                                   "thinking"),
                                  ("messages", {**ASK_BODY, "messages": [thought, *ASK_BODY["messages"]]},
                                   "messages[0].content[0].type")]:
            response = _post(server, f"/s/{session}/v1/{path}", body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and param in error["message"], error
            assert "no reasoning format" in error["message"], error
        assert _post(server, f"/s/{session}/v1/messages", ASK_BODY).status_code == 200  # the rest still works
        assert server.finish(session, reward=0.0)[0].num_trainable > 0
    finally:
        server.stop()
