"""SFT data: assistant masks read off real chat templates, trajectory records token-exact, files and their errors.

The tokenizer is the tiny chat model's (real, byte-level BPE); the Qwen3- and Llama-3-style templates below are
set on copies of it. Its vocabulary does not hold Llama's header tokens, which then split into several tokens:
the masks are still right, as the expected spans show.
"""

import base64
import copy
import gzip
import io
import json

import pytest
from transformers import AutoTokenizer

from molt_agents.chat_template import render_text
from molt_agents.multimodal import Vision, chat_images, for_template
from molt_agents.tiny import model_dir
from molt_env.trajectory import Trajectory
from molt_train.sft_data import chat_examples, load_examples, trajectory_examples

# Qwen3's template, shortened: tools in the system prompt, tool results as a user turn, and `<think>` written only
# for assistant turns after the last user message (earlier turns lose theirs).
QWEN3_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nFunction signatures within <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for message in messages -%}{%- if message.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.reasoning_content and loop.index0 > ns.last_query -%}"
    "{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message.content or '' -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + call.function.arguments"
    " + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Llama 3.1's template, shortened: headers and `<|eot_id|>`, a tool call as the whole reply in JSON with
# "parameters", tool results as `ipython` turns; it has no place for reasoning and drops it.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- if tools or messages[0].role == 'system' -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}"
    "{%- if tools -%}"
    "{{- 'Environment: ipython\\n\\nYou have access to these functions:\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content | trim -}}{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role == 'system' -%}"
    "{%- elif message.tool_calls -%}"
    "{%- set call = message.tool_calls[0].function -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + call.name + '\", \"parameters\": '"
    " + call.arguments + '}<|eot_id|>' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' -}}"
    "{%- else -%}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]

CALL = {"type": "function", "function": {"name": "python", "arguments": '{"code": "print(3 + 4)"}'}}
CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should run it.", "tool_calls": [CALL]},
    {"role": "tool", "content": "7"},
    {"role": "assistant", "content": "It is 7.", "reasoning_content": "The tool printed 7."},
]

# Two questions: a template that drops earlier reasoning renders the first reply differently once the second
# question follows.
TWO_QUESTIONS = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "7", "reasoning_content": "Add them."},
    {"role": "user", "content": "And twice that?"},
    {"role": "assistant", "content": "14", "reasoning_content": "Double 7."},
]


@pytest.fixture(scope="module")
def tiny():
    return AutoTokenizer.from_pretrained(model_dir("tiny:chat"))


@pytest.fixture(scope="module")
def qwen3(tiny):
    tokenizer = copy.deepcopy(tiny)
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def llama3(tiny):
    tokenizer = copy.deepcopy(tiny)
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


def trained_runs(tokenizer, example) -> list[str]:
    """The text of each run of consecutive trained tokens."""
    runs, run = [], []
    for token, trained in zip(example.token_ids, example.mask):
        if trained:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return [tokenizer.decode(run) for run in runs + [run] * bool(run)]


def assert_tokenized_like_the_runner(tokenizer, example, messages, tools=None):
    assert len(example.mask) == len(example.token_ids)
    text = render_text(tokenizer, messages, tools, add_generation_prompt=False)
    assert example.token_ids == tokenizer.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------
# Chat conversations


def test_tiny_template_trains_every_reply_with_its_reasoning_tool_call_and_end_token(tiny):
    [example] = chat_examples(tiny, CONVERSATION, TOOLS, source="chat.jsonl:1")
    assert_tokenized_like_the_runner(tiny, example, CONVERSATION, TOOLS)
    assert example.source == "chat.jsonl:1"
    assert trained_runs(tiny, example) == [
        '<think>\nI should run it.\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"code": "print(3 + 4)"}}'
        '\n</tool_call><|im_end|>',
        "<think>\nThe tool printed 7.\n</think>\n\nIt is 7.<|im_end|>",
    ]


def test_qwen3_style_template_with_one_question_is_one_example(qwen3):
    [example] = chat_examples(qwen3, CONVERSATION, TOOLS)
    assert_tokenized_like_the_runner(qwen3, example, CONVERSATION, TOOLS)
    assert trained_runs(qwen3, example) == [
        '<think>\nI should run it.\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"code": "print(3 + 4)"}}'
        '\n</tool_call><|im_end|>',
        "<think>\nThe tool printed 7.\n</think>\n\nIt is 7.<|im_end|>",
    ]
    assert "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>" in qwen3.decode(example.token_ids)


def test_llama3_style_template_trains_the_json_call_and_the_answer(llama3):
    [example] = chat_examples(llama3, CONVERSATION, TOOLS)
    assert_tokenized_like_the_runner(llama3, example, CONVERSATION, TOOLS)
    assert trained_runs(llama3, example) == [
        '{"name": "python", "parameters": {"code": "print(3 + 4)"}}<|eot_id|>',
        "It is 7.<|eot_id|>",
    ]
    assert "I should run it" not in llama3.decode(example.token_ids)  # the template drops reasoning


def test_last_turn_only_trains_the_last_reply(tiny, qwen3, llama3):
    for tokenizer, last in ((tiny, "<think>\nThe tool printed 7.\n</think>\n\nIt is 7.<|im_end|>"),
                            (qwen3, "<think>\nThe tool printed 7.\n</think>\n\nIt is 7.<|im_end|>"),
                            (llama3, "It is 7.<|eot_id|>")):
        [example] = chat_examples(tokenizer, CONVERSATION, TOOLS, last_turn_only=True)
        assert_tokenized_like_the_runner(tokenizer, example, CONVERSATION, TOOLS)
        assert trained_runs(tokenizer, example) == [last]


def test_a_template_that_drops_earlier_reasoning_gets_one_example_per_reply(qwen3, tiny):
    first, second = chat_examples(qwen3, TWO_QUESTIONS, source="chat.jsonl:2")
    assert_tokenized_like_the_runner(qwen3, first, TWO_QUESTIONS[:2])
    assert trained_runs(qwen3, first) == ["<think>\nAdd them.\n</think>\n\n7<|im_end|>"]
    assert_tokenized_like_the_runner(qwen3, second, TWO_QUESTIONS)
    assert trained_runs(qwen3, second) == ["<think>\nDouble 7.\n</think>\n\n14<|im_end|>"]
    assert "<|im_start|>assistant\n7<|im_end|>" in qwen3.decode(second.token_ids)  # as the model then saw it
    assert first.source == second.source == "chat.jsonl:2"

    [last] = chat_examples(qwen3, TWO_QUESTIONS, last_turn_only=True)
    assert (last.token_ids, last.mask) == (second.token_ids, second.mask)

    [whole] = chat_examples(tiny, TWO_QUESTIONS)  # the tiny template keeps every turn's reasoning
    assert trained_runs(tiny, whole) == ["<think>\nAdd them.\n</think>\n\n7<|im_end|>",
                                         "<think>\nDouble 7.\n</think>\n\n14<|im_end|>"]


def test_chat_errors_name_the_record(tiny):
    with pytest.raises(ValueError, match="chat.jsonl:3: the conversation has no assistant message"):
        chat_examples(tiny, [{"role": "user", "content": "Hi"}], source="chat.jsonl:3")
    picture = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(ValueError, match="chat.jsonl:5: the conversation holds images and the model has no image "
                                         "processor"):
        chat_examples(tiny, [{"role": "user", "content": picture}, {"role": "assistant", "content": "A cat."}],
                      source="chat.jsonl:5")
    opening = copy.deepcopy(tiny)  # DeepSeek-R1's way: the generation prompt opens `<think>`, a rendered turn does not
    opening.chat_template = QWEN3_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
                                                   "{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}")
    with pytest.raises(ValueError, match="chat.jsonl:4: assistant turn 1: the chat template renders the reply "
                                         "differently from its generation prompt"):
        chat_examples(opening, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                      source="chat.jsonl:4")


def test_a_token_that_begins_in_the_prompt_is_not_trained(tiny):
    # The replies above start and end on token boundaries. A generation prompt that ends with a space ("assistant: ")
    # lets BPE merge it with the reply's first word: " is" begins in the prompt, so it is left untrained.
    spaced = copy.deepcopy(tiny)
    spaced.chat_template = ("{%- for m in messages -%}{{- m.role + ': ' + m.content + '\\n' -}}{%- endfor -%}"
                            "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}")
    messages = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "is 7."}]
    [example] = chat_examples(spaced, messages)
    assert_tokenized_like_the_runner(spaced, example, messages)
    assert trained_runs(spaced, example) == [" 7."]


def picture(colour) -> dict:
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(png, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}}


def test_chat_with_images_expands_each_picture_as_the_runner_does_and_never_trains_it():
    vision = Vision(model_dir("tiny:vlm"))
    messages = [{"role": "user", "content": [picture((255, 0, 0)), {"type": "text", "text": "How many?"}]},
                {"role": "assistant", "content": "2"},
                {"role": "user", "content": [{"type": "text", "text": "And here?"}, picture((0, 0, 255))]},
                {"role": "assistant", "content": "3"}]
    [example] = chat_examples(vision.tokenizer, messages, source="chat.jsonl:6", vision=vision)
    # The runner's encoding: the template's text with one placeholder per image, each expanded by the processor.
    text = render_text(vision.tokenizer, for_template(messages), add_generation_prompt=False)
    ids, spans, tensors = vision.encode(text, chat_images(messages))
    assert example.token_ids == ids and len(example.mask) == len(ids)
    assert len(spans) == 2 and all(length > 1 for _, length in spans)
    assert not any(any(example.mask[start:start + length]) for start, length in spans)
    assert trained_runs(vision.tokenizer, example) == ["2<|im_end|>", "3<|im_end|>"]
    pixels = example.images["pixel_values"]  # both pictures, in order, along Idefics3's image axis
    assert pixels.shape[:2] == (1, 2)
    assert (pixels[0, 0] == tensors[0]["pixel_values"][0, 0]).all() and (pixels[0, 1] != pixels[0, 0]).any()


# --------------------------------------------------------------------------
# Trajectory records


def trajectory(n: int, rollout: str, group: str, reward: float, segment: int = 0, segments: int = 1, **extra) -> dict:
    """A valid record whose tokens (100 * n ...) tell records apart."""
    record = Trajectory(token_ids=[100 * n, 100 * n + 1, 100 * n + 2, 7], logprobs=[None, -0.5, None, -0.25],
                        mask=[0, 1, 0, 1], versions=[-1, 3, -1, 3], reward=reward, rollout_id=rollout, group_id=group,
                        segment=segment, num_segments=segments).to_dict()
    return {**extra, **record}


# Group "0": rollout 0-1 (two segments) and 0-2 tie on the best reward, so 0-1 (first in file order) is the best.
# The evaluation play has group id "0" too, as saved rollouts name them, and the highest reward: it is never trained.
RECORDS = [
    trajectory(1, "0-0", "0", 0.0, split="train", step=1),
    trajectory(2, "0-1", "0", 1.0, segment=0, segments=2, split="train", step=1),
    trajectory(3, "eval-0-0", "0", 5.0, split="eval", step=1),
    trajectory(4, "0-1", "0", 1.0, segment=1, segments=2, split="train", step=1),
    trajectory(5, "0-2", "0", 1.0, split="train", step=1),
    trajectory(6, "1-0", "1", 0.5, split="train", step=1),
    trajectory(7, "1-1", "1", 0.25, split="train", step=1),
]


def kept(examples) -> list[int]:
    """Which records (by n) the examples are, checking that each comes back token-exact."""
    ns = [example.token_ids[0] // 100 for example in examples]
    for n, example in zip(ns, examples):
        assert example.token_ids == [100 * n, 100 * n + 1, 100 * n + 2, 7] and example.mask == [0, 1, 0, 1]
    return ns


def test_trajectory_records_are_trained_token_exact_and_eval_plays_never():
    examples = trajectory_examples(RECORDS)
    assert kept(examples) == [1, 2, 4, 5, 6, 7]
    assert [example.source for example in examples] == ["record 0", "record 1", "record 3", "record 4", "record 5",
                                                        "record 6"]


def test_min_reward_and_best_of_group_select_rollouts():
    assert kept(trajectory_examples(RECORDS, min_reward=0.5)) == [2, 4, 5, 6]
    assert kept(trajectory_examples(RECORDS, best_of_group=True)) == [2, 4, 6]  # both segments of 0-1
    assert kept(trajectory_examples(RECORDS, min_reward=0.75, best_of_group=True)) == [2, 4]


def test_invalid_trajectory_records_are_named():
    broken = {**trajectory(1, "0-0", "0", 0.0), "mask": [1, 1, 0, 1]}
    with pytest.raises(ValueError, match="record 1: not a valid trajectory record: first_token_trainable"):
        trajectory_examples([trajectory(2, "0-1", "0", 0.0), broken])
    with pytest.raises(ValueError, match="record 0: best_of_group needs a group_id and a rollout_id"):
        trajectory_examples([trajectory(1, "", "", 0.0)], best_of_group=True)


# --------------------------------------------------------------------------
# Files


def test_saved_rollouts_directory_with_a_half_written_end(tmp_path, tiny):
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    lines = [json.dumps(record) + "\n" for record in RECORDS]
    with gzip.open(rollouts / "steps_000003.jsonl.gz", "wt") as out:
        out.writelines(lines[5:])
    with open(rollouts / "steps_000001.jsonl.gz", "wb") as out:  # two members and half of a third
        out.write(gzip.compress("".join(lines[:3]).encode()) + gzip.compress("".join(lines[3:5]).encode()))
        half = gzip.compress(json.dumps(trajectory(9, "9-0", "9", 1.0)).encode() + b"\n")
        out.write(half[: len(half) // 2])
    examples = load_examples(rollouts, tiny)
    assert kept(examples) == [1, 2, 4, 5, 6, 7]
    assert examples[2].source == f"{rollouts / 'steps_000001.jsonl.gz'}:4"
    assert examples[4].source == f"{rollouts / 'steps_000003.jsonl.gz'}:1"
    assert kept(load_examples(rollouts, tiny, best_of_group=True)) == [2, 4, 6]  # groups pooled across files
    with pytest.raises(ValueError, match="no examples were left after the filters min_reward=2.0, best_of_group"):
        load_examples(rollouts, tiny, min_reward=2.0, best_of_group=True)


def test_chat_file(tmp_path, tiny):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION, "tools": TOOLS}) + "\n\n"
                    + json.dumps({"messages": TWO_QUESTIONS}) + "\n")
    first, second = load_examples(path, tiny, last_turn_only=True)
    assert (first.source, second.source) == (f"{path}:1", f"{path}:3")
    assert trained_runs(tiny, first) == ["<think>\nThe tool printed 7.\n</think>\n\nIt is 7.<|im_end|>"]
    assert trained_runs(tiny, second) == ["<think>\nDouble 7.\n</think>\n\n14<|im_end|>"]
    with pytest.raises(ValueError, match="min_reward=0.5 select trajectory records"):
        load_examples(path, tiny, min_reward=0.5)


def test_file_errors_name_the_file_and_line(tmp_path, tiny):
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({"prompt": "What is 3 + 4?", "completion": "7"}) + "\n")
    with pytest.raises(ValueError, match=f"{unknown}:1: neither a chat record"):
        load_examples(unknown, tiny)
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text(json.dumps({"messages": CONVERSATION}) + "\n{\"messages\": [\n")
    with pytest.raises(ValueError, match=f"{malformed}:2: not a JSON line"):
        load_examples(malformed, tiny)
    silent = tmp_path / "silent.jsonl"
    silent.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    with pytest.raises(ValueError, match=f"{silent}:1: the conversation has no assistant message"):
        load_examples(silent, tiny)
    with pytest.raises(ValueError, match="kind 'sft'"):
        load_examples(silent, tiny, kind="sft")
    with pytest.raises(ValueError, match="no such file or directory"):
        load_examples(tmp_path / "missing.jsonl", tiny)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no examples were left$"):
        load_examples(empty, tiny)
