"""The loopback's Responses API (`client.responses.create`), driven by the real `openai` SDK on the real vLLM engine.

The route is a translation onto the chat route, so the checks are the chat
route's: the captured sampled tokens carry the engine's logprobs (equal to an
independent transformers forward), and a tool episode played through the
Responses API leaves the trajectory that Chat Completions leaves, token for token.
"""

import json

import openai
import pytest
import torch
from test_loopback import QUESTION, TOOLS, _client, _max_trained_logprob_error, _post, tool_policy  # noqa: F401
from transformers import AutoModelForCausalLM

from molt_env.trajectory import check

# The chat tools of test_loopback in Responses' flat shape.
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
INSTRUCTIONS, ASK = QUESTION[0]["content"], QUESTION[1]["content"]


def _stream(client, **request):
    """Stream a response: its event types, text deltas, function-call argument deltas and final response."""
    types, text, arguments, final = [], "", "", None
    for event in client.responses.create(model="policy", stream=True, **request):
        types.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return types, text, arguments, final


def test_text_replies_streamed_and_not_are_captured_token_exact(loopback, dense_dir):
    session = loopback.open_session(defaults={"seed": 3}).id
    client = _client(loopback, session)
    first = client.responses.create(model="policy", instructions="Be brief.", input="What is 3 + 4?",
                                    max_output_tokens=12, temperature=1.0)
    assert first.status in ("completed", "incomplete") and first.output[0].type == "message"
    types, streamed, _, second = _stream(client, previous_response_id=first.id, input="Go on.", max_output_tokens=12)
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types.count("response.output_text.delta") > 1, "the reply should arrive token by token"
    assert types[-2:] == ["response.output_item.done", f"response.{second.status}"]
    assert streamed == second.output_text

    # The untrained model's replies may hold special tokens the client never sees; the rendered history then
    # differs from the sampled tokens and a second segment starts (the tool episode below stitches one).
    trajectories = loopback.finish(session, reward=1.0)
    for trajectory in trajectories:
        check(trajectory)
    assert sum(t.num_trainable for t in trajectories) == first.usage.output_tokens + second.usage.output_tokens
    last = trajectories[-1]
    assert len(last.token_ids) == second.usage.input_tokens + second.usage.output_tokens
    text = loopback.tokenizer.decode(last.token_ids, skip_special_tokens=True)
    assert first.output_text in text and text.endswith(second.output_text) and "Go on." in text
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    error = max(_max_trained_logprob_error(model, trajectory) for trajectory in trajectories)
    print(f"responses text: max |engine - transformers| logprob over "
          f"{sum(t.num_trainable for t in trajectories)} tokens = {error:.2e}")
    assert error < 1e-5


def _chat_episode(loopback):
    session = loopback.open_session(defaults={"seed": 0}).id
    client, messages = _client(loopback, session), list(QUESTION)
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=48)
    (call,) = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "391"}]
    client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=24)
    return loopback.finish(session, reward=1.0)


def _responses_episode_by_id(loopback):
    session = loopback.open_session(defaults={"seed": 0}).id
    client = _client(loopback, session)
    first = client.responses.create(model="policy", instructions=INSTRUCTIONS, input=ASK, tools=RESPONSES_TOOLS,
                                    max_output_tokens=48)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "python" and json.loads(call.arguments) == {"code": "print(17 * 23)"}
    second = client.responses.create(
        model="policy", instructions=INSTRUCTIONS, previous_response_id=first.id, tools=RESPONSES_TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "391"}], max_output_tokens=24)
    assert "391" in second.output_text
    return loopback.finish(session, reward=1.0)


def _responses_episode_by_input_list(loopback):
    """The agent keeps the conversation itself (store: false), the first turn streamed."""
    session = loopback.open_session(defaults={"seed": 0}).id
    client = _client(loopback, session)
    items = [{"role": "user", "content": ASK}]
    types, _, arguments, first = _stream(client, instructions=INSTRUCTIONS, input=items, tools=RESPONSES_TOOLS,
                                         max_output_tokens=48, store=False)
    assert "response.function_call_arguments.delta" in types and "<tool_call>" not in json.dumps(types)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert arguments == call.arguments
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "391"})
    client.responses.create(model="policy", instructions=INSTRUCTIONS, input=items, tools=RESPONSES_TOOLS,
                            max_output_tokens=24, store=False)
    with pytest.raises(openai.BadRequestError, match="store: false"):
        client.responses.create(model="policy", previous_response_id=first.id, input="Thanks.")
    return loopback.finish(session, reward=1.0)


def test_tool_episode_is_the_chat_completions_trajectory(loopback, tool_policy, dense_dir):  # noqa: F811
    (chat,) = _chat_episode(loopback)
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    model.load_state_dict(tool_policy)
    for played in (_responses_episode_by_id, _responses_episode_by_input_list):
        (trajectory,) = played(loopback)  # one segment: the second turn extended the first
        check(trajectory)
        assert trajectory.token_ids == chat.token_ids, played.__name__
        assert trajectory.mask == chat.mask and trajectory.versions == chat.versions
        sampled = [lp for m, lp in zip(trajectory.mask, trajectory.logprobs) if m]
        assert sampled == pytest.approx([lp for m, lp in zip(chat.mask, chat.logprobs) if m], abs=1e-6)
        error = _max_trained_logprob_error(model, trajectory)
        print(f"{played.__name__}: {len(trajectory.token_ids)} tokens equal to the chat episode's, "
              f"max |engine - transformers| logprob over {trajectory.num_trainable} sampled = {error:.2e}")
        assert error < 1e-5
    text = loopback.tokenizer.decode(chat.token_ids)
    assert text.count("<|im_start|>assistant") == 2 and "<tool_response>\n391\n</tool_response>" in text


ASK_BODY = {"model": "policy", "input": "x", "max_output_tokens": 2}


@pytest.mark.parametrize("extra,param", [
    ({"input": None}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "python", "arguments": "{}"}]}, "input[0].call_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"previous_response_id": "resp-unknown"}, "previous_response_id"),
    ({"temperature": 2.5}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
])
def test_bad_requests_get_a_400_naming_the_field(loopback, extra, param):
    session = loopback.open_session().id
    response = _post(loopback, f"/s/{session}/v1/responses", {**ASK_BODY, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert loopback.finish(session, reward=0.0) == []  # nothing was captured


def test_a_session_mixes_protocols_on_one_segment(loopback):
    """A stored Responses turn continued by Chat Completions (and back) stays one stitched segment."""
    session = loopback.open_session(defaults={"seed": 1}).id
    client = _client(loopback, session)
    first = client.responses.create(model="policy", input="Hi.", max_output_tokens=4)
    second = client.chat.completions.create(model="policy", max_tokens=4, messages=[
        {"role": "user", "content": "Hi."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More."}])
    (trajectory,) = loopback.finish(session, reward=0.0)
    assert trajectory.num_trainable == first.usage.output_tokens + second.usage.completion_tokens
