"""Every loopback route, fuzzed: no input gets a 5xx, and no input costs a session.

Hypothesis builds near-valid requests: a valid request for the route, then a
few mutations (a field set to a wrong type, a huge or negative integer, NaN
or Infinity, deep nesting, unicode or a lone surrogate, a long string; a key
dropped or added; the whole body replaced). Each goes over a socket to the
loopback on the real vLLM engine, sent to a freshly opened session. After it,
that session, which already holds one sampled turn, must still take a small
chat request, and finishing it must deliver its segments to `on_finish`
exactly once.
"""

import json
import re
from collections import Counter
from urllib.parse import quote

import httpx
import pytest
from conftest import live_loopback
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_agents.loopback.protocol import MAX_NESTING

# Per route; together about 55 s on two CPU cores, after the engine's start.
EXAMPLES = {"models": 40, "chat": 150, "chat_stream": 100, "completions": 100, "responses": 100, "messages": 60,
            "count_tokens": 40, "finish": 100, "unknown_path": 40}
SMALL_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "seed": 0}
TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "python", "parameters": {"type": "object"}}]
ANTHROPIC_TOOLS = [{"name": "python", "input_schema": {"type": "object"}}]
# How a 500 reads inside a stream that had already started (chat chunks; a Responses or Anthropic `error` event).
SERVER_ERROR = re.compile(r'"(type|code)": "(server_error|api_error)"')


# --------------------------------------------------------------------------
# Values: the mutations' material


class Nested:
    """`depth` levels of `[[...]]`, spliced into the body as text: too deep for json.dumps to write."""

    def __init__(self, depth: int):
        self.depth = depth


def dumps(value) -> bytes:
    """JSON text as a sloppy client writes it: NaN and Infinity literals, surrogates escaped."""
    text = json.dumps(value, default=lambda nested: f"@@nested{nested.depth}@@")
    return re.sub(r'"@@nested(\d+)@@"', lambda m: "[" * int(m[1]) + "]" * int(m[1]), text).encode()


NUMBER_EDGES = [0, -1, 1, 3, 20, 21, 64, 65, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63),
                -(2**63) - 1, 2**64, 2**70, -(2**70), 10**400,
                0.5, -0.0, 2.5, 1e-300, 1e308, float("nan"), float("inf"), -float("inf")]  # the last: bare literals
STRING_EDGES = ["", "NaN", "Infinity", "1e999", "policy", "user", "text", "function", "\ud800", "a\udfffb",
                "é 世界 🙂", "\x00", "<|im_end|>", "<tool_call>"]  # "\ud800": a lone surrogate, escaped
edges = st.one_of(
    st.sampled_from(NUMBER_EDGES), st.sampled_from(STRING_EDGES),
    st.sampled_from([MAX_NESTING - 2, MAX_NESTING - 1, MAX_NESTING, 1_000, 100_000]).map(Nested),
    st.integers(1_000, 300_000).map(lambda n: "x" * n),  # long, well within the 8 MiB body limit
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20),
                    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2), edges)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) |
                      st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
mutant = edges | values  # a field's new value: an edge case half the time

# --------------------------------------------------------------------------
# Valid requests, per route


text = st.text(max_size=24)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": text, "tool_call_id": text}),
)
sampling = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "seed": st.integers(-(2**63), 2**63 - 1), "n": st.integers(1, 2),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2) | st.text(min_size=1, max_size=4),
    "presence_penalty": st.just(0), "user": text, "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}),
}


@st.composite
def near_valid(draw, required: dict, optional: dict):
    """A valid request (the required fields, a few optional ones) with up to three mutations;
    now and then a body that is no request at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=64) | values.map(dumps))
    body = {key: draw(value) for key, value in required.items()}
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=6)):
        body[key] = draw(optional[key])  # fixed_dictionaries' optional keys are rarely drawn
    fields = sorted({*required, *optional})
    for _ in range(draw(st.integers(0, 3))):
        if not isinstance(body, dict):  # wrapped in a list
            break
        kind = draw(st.sampled_from(["field", "field", "field", "message", "drop", "extra", "wrap"]))
        if kind == "field":
            body[draw(st.sampled_from(fields))] = draw(mutant)
        elif kind == "message" and isinstance(body.get("messages"), list) and body["messages"]:
            target = body["messages"][draw(st.integers(0, len(body["messages"]) - 1))]
            if isinstance(target, dict):
                target[draw(st.sampled_from(["role", "content", "tool_calls", "name", "tool_call_id"]))] = draw(mutant)
        elif kind == "drop" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        elif kind == "extra":
            body[draw(st.text(max_size=12))] = draw(mutant)
        elif kind == "wrap":
            body = draw(st.sampled_from([[body], {"body": body}, {"messages": body}]))
    return dumps(body)


def chat(stream: bool):
    return near_valid(
        {"model": st.just("policy"), "messages": st.lists(message, min_size=1, max_size=3),
         "max_tokens": st.integers(1, 3), "stream": st.just(stream)},
        {**sampling, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3),
         "tools": st.just(TOOLS), "tool_choice": st.sampled_from(["auto", "none"]),
         "max_completion_tokens": st.integers(1, 3), "response_format": st.just({"type": "text"})})


completion = near_valid(
    {"model": st.just("policy"), "max_tokens": st.integers(1, 3),
     "prompt": text.filter(bool) | st.lists(st.integers(0, 1000), min_size=1, max_size=8)},
    {**sampling, "logprobs": st.integers(0, 3), "echo": st.just(False), "stream": st.booleans()})
item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": text}),
    st.fixed_dictionaries({"type": st.just("message"), "role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("input_text"), "text": text}), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text, "name": st.just("python"),
                           "arguments": st.just("{}")}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text, "output": text}),
)
responses = near_valid(
    {"model": st.just("policy"), "input": text | st.lists(item, min_size=1, max_size=3),
     "max_output_tokens": st.integers(1, 3)},
    {"instructions": text, "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "stream": st.booleans(),
     "tools": st.just(RESPONSES_TOOLS), "tool_choice": st.sampled_from(["auto", "none"]), "store": st.booleans(),
     "previous_response_id": text, "user": text, "text": st.just({"format": {"type": "text"}})})
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("image"), "source": st.fixed_dictionaries(
        {"type": st.just("base64"), "media_type": st.just("image/png"), "data": text})}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text, "content": text}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": st.just("python"),
                           "input": st.just({})}),
)
anthropic_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                           "content": text | st.lists(block, min_size=1, max_size=2)})
conversation = {"model": st.just("policy"), "messages": st.lists(anthropic_message, min_size=1, max_size=3)}
count_tokens = near_valid(conversation, {"tools": st.just(ANTHROPIC_TOOLS), "system": text})
messages = near_valid(
    {**conversation, "max_tokens": st.integers(1, 3)},
    {"system": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2),
     "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1), "stream": st.booleans(),
     "stop_sequences": st.lists(st.text(min_size=1, max_size=4), max_size=2), "tools": st.just(ANTHROPIC_TOOLS),
     "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}]), "metadata": st.just({})})
finish = near_valid(
    {"reward": st.floats(-1e6, 1e6) | st.integers(-(10**6), 10**6)},
    {"info": st.none() | st.dictionaries(st.text(max_size=6), st.integers() | text, max_size=3)})

# --------------------------------------------------------------------------
# Sending, per route: (method, path, body) for a session


path_text = st.text(max_size=16).map(lambda s: quote(s, safe=""))
ROUTES = {
    "models": st.tuples(st.just("GET"), st.just("/v1/models"), st.binary(max_size=32) | values.map(dumps)),
    "chat": st.tuples(st.just("POST"), st.just("/v1/chat/completions"), chat(stream=False)),
    "chat_stream": st.tuples(st.just("POST"), st.just("/v1/chat/completions"), chat(stream=True)),
    "completions": st.tuples(st.just("POST"), st.just("/v1/completions"), completion),
    "responses": st.tuples(st.just("POST"), st.just("/v1/responses"), responses),
    "messages": st.tuples(st.just("POST"), st.just("/v1/messages"), messages),
    "count_tokens": st.tuples(st.just("POST"), st.just("/v1/messages/count_tokens"), count_tokens),
    "finish": st.tuples(st.just("POST"), st.just("/finish"), finish),
    "unknown_path": st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
                              st.one_of(path_text.map(lambda p: "/v1/" + p), path_text.map(lambda p: "/../" + p),
                                        st.just("/v1/chat/completions/"), st.just("/finish/x")),
                              values.map(dumps)),
}


@pytest.fixture(scope="module")
def loopback(vllm_engines, dense_dir):
    """conftest's loopback with a 320-token context (tools and three short messages fit): a fuzzed
    `max_tokens` of 2**70 is served, sampling to the end of the context, so that end is kept near."""
    yield from live_loopback(vllm_engines, dense_dir, max_model_len=320)


@pytest.mark.parametrize("route", list(ROUTES))
def test_no_input_gets_a_5xx_or_loses_a_session(loopback, route):
    statuses = Counter()
    client = httpx.Client(base_url=f"http://127.0.0.1:{loopback.port}", timeout=120,
                          headers={"Authorization": f"Bearer {loopback.api_key}"})

    @settings(max_examples=EXAMPLES[route], deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(ROUTES[route])
    def one_request(request):
        method, path, body = request
        session = loopback.open_session().id
        assert client.post(f"/s/{session}/v1/chat/completions", json=SMALL_CHAT).status_code == 200
        response = client.request(method, f"/s/{session}{path}", content=body,
                                  headers={"Content-Type": "application/json"})
        statuses[500 if SERVER_ERROR.search(response.text) else response.status_code] += 1
        assert response.status_code < 500, response.text[:2000]
        assert not SERVER_ERROR.search(response.text), response.text[:2000]

        if route == "finish" and response.status_code == 200:  # a valid finish
            done = response
        else:  # the session took no harm: it still serves, and finishes
            witness = client.post(f"/s/{session}/v1/chat/completions", json=SMALL_CHAT)
            assert witness.status_code == 200, witness.text
            done = client.post(f"/s/{session}/finish", json={"reward": 1.0})
            assert done.status_code == 200, done.text
        assert done.json()["segments"] >= 1  # the turn sampled before the fuzzed request, at least
        delivered = [t for t in loopback.captured if t.info["session"] == session]
        assert len(delivered) == done.json()["segments"]
        assert sum(t.num_trainable for t in delivered) == done.json()["trainable_tokens"]
        assert client.post(f"/s/{session}/finish", json={"reward": 1.0}).status_code == 404

    try:
        one_request()
    finally:
        client.close()
        seen = ", ".join(f"{status}: {count}" for status, count in sorted(statuses.items()))
        print(f"\nloopback fuzz {route}: {statuses.total()} examples tried, "
              f"{sum(n for status, n in statuses.items() if status >= 500)} 5xx seen (statuses {seen})")
