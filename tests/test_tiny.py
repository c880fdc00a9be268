"""The offline tiny models: deterministic builds, and a tokenizer whose chat template round-trips."""

import hashlib
import json
from pathlib import Path

import pytest

from molt_agents.tiny import build_tiny
from molt_agents.tiny.build import main as molt_tiny

ROOT = Path(__file__).resolve().parents[1]

TOOLS = [{
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return its output.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}]

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 17 * 23?"},
    {"role": "assistant", "reasoning_content": "Multiply with the tool.", "content": "Let me compute it.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "python", "arguments": "{\"code\": \"print(17 * 23)\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "391"},
    {"role": "assistant", "content": "17 * 23 = 391."},
]


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("kind", ["dense", "moe", "vlm"])
def test_molt_tiny_is_deterministic(kind, tmp_path, capsys):
    molt_tiny(["--kind", kind, "--out", str(tmp_path / "a")])
    build_tiny(kind, tmp_path / "b")
    a, b = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(a)
    assert a == b


def test_tiny_model_respects_engine_constraints(dense_dir, moe_dir):
    for directory in (dense_dir, moe_dir):
        config = json.loads((directory / "config.json").read_text())
        assert config["head_dim"] >= 32
        assert config["tie_word_embeddings"] is False
        assert config["vocab_size"] % 64 == 0
        assert config["dtype"] == "float32"
    assert json.loads((moe_dir / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_bad_sizes_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="head_dim=16"):
        build_tiny("dense", tmp_path, head_dim=16)
    with pytest.raises(ValueError, match="multiple of 64"):
        build_tiny("dense", tmp_path, vocab_size=1000)
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        build_tiny("rnn", tmp_path)
    with pytest.raises(ValueError, match=r"multiple of patch_size \* scale_factor"):
        build_tiny("vlm", tmp_path, image_size=50)


def test_tiny_vlm_loads_with_its_processor_and_sees_the_image():
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from molt_agents.tiny import tiny_model

    directory = tiny_model("vlm")
    processor = AutoProcessor.from_pretrained(directory)  # no torchvision: the PIL image processor
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (80, 64, 3), dtype=np.uint8))
    red = Image.new("RGB", (30, 90), "red")
    a, b = (processor(text=[text], images=[image], return_tensors="pt") for image in (noise, red))
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert int((a["input_ids"] == model.config.image_token_id).sum()) == (56 // 14 // 2) ** 2  # 4 patches each
    with torch.no_grad():
        assert (model(**a).logits - model(**b).logits).abs().max() > 1e-2, "the image made no difference"


def test_tiny_vlm_warm_start_taught_it_to_look():
    """The alignment pretext: a one-colour picture's answer is the colour's index, so the reply depends
    on the picture (a text-only warm start left it answering the same for every picture)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from molt_agents.tiny import tiny_model
    from molt_agents.tiny.warm_start import PALETTE, QUESTIONS

    directory = tiny_model("vlm")
    processor = AutoProcessor.from_pretrained(directory)
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    digits = processor.tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    answers = []
    for colour in PALETTE:
        inputs = processor(text=[text], images=[Image.new("RGB", (40, 40), colour)], return_tensors="pt")
        with torch.no_grad():
            answers.append(int(model(**inputs).logits[0, -1, digits].argmax()))
    assert sum(a == i for i, a in enumerate(answers)) >= 8, answers


def test_tiny_chat_answers_a_choice_with_an_offered_word_and_anything_else_with_a_digit():
    """The chat model's two reply formats: a line that offers words ("yes or no") gets one of them, each
    near chance (the warm start draws it at random), and a line without "or" a digit, each asked digit
    near chance too; neither depends on what the line asks."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt_agents.tiny import tiny_model

    directory = tiny_model("chat")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)

    def first_token(line):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": line}], add_generation_prompt=True,
                                            return_dict=True, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            return torch.softmax(model(ids).logits[0, -1], -1)

    digits = tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    for asked in range(10):
        p = first_token(f"Repeat the digit {asked}.")
        assert p[digits].sum() > 0.95 and 0.03 < p[digits[asked]] < 0.3, (asked, p[digits])
    for line, offered in [("Is 7 even? Answer yes or no.", ["yes", "no"]),
                          ("Which way now: left, right or up?", ["left", "right", "up"]),
                          ("Is the answer true or false?", ["true", "false"])]:
        p = first_token(line)[tokenizer.convert_tokens_to_ids([f"\u0120{word}" for word in offered])]
        assert p.sum() > 0.6 and p.min() > 0.03, (line, p)


def test_chat_template_round_trips_tools_and_tool_calls(dense_dir):
    from transformers import AutoTokenizer

    from molt_agents.chat_template import render_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    ids = render_prompt_ids(tokenizer, CONVERSATION, tools=TOOLS, add_generation_prompt=False)
    assert tokenizer.decode(ids) == text  # byte-level BPE: decode(encode(text)) == text

    # The tool signature, the call and its result are all in the rendered text.
    assert json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "python", "arguments": {"code": "print(17 * 23)"}}\n</tool_call>' in text
    assert "<tool_response>\n391\n</tool_response>" in text
    assert "<think>\nMultiply with the tool.\n</think>" in text

    # Control and markup tokens are single tokens; markup survives skip_special_tokens.
    for token in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert "<tool_call>" in kept and "<|im_start|>" not in kept


def test_chat_template_is_prefix_stable(dense_dir):
    """Rendering a shorter conversation gives a prefix of the longer one (multi-turn stitching)."""
    from transformers import AutoTokenizer

    from molt_agents.chat_template import render_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    full = render_prompt_ids(tokenizer, CONVERSATION, tools=TOOLS, add_generation_prompt=False)
    for cut in range(2, len(CONVERSATION)):
        prefix = render_prompt_ids(tokenizer, CONVERSATION[:cut], tools=TOOLS, add_generation_prompt=False)
        assert full[: len(prefix)] == prefix, f"not prefix-stable after {cut} messages"
    prompt = render_prompt_ids(tokenizer, CONVERSATION[:2], tools=TOOLS, add_generation_prompt=True)
    assert full[: len(prompt)] == prompt


def test_a_model_of_a_real_models_shape_with_the_tokenizer_padded_to_its_vocabulary(tmp_path, capsys):
    """`molt-tiny --like DIR`: the shape of DIR/config.json (here Qwen3-0.6B's, narrowed to build in a second;
    `bench/real_size.py` builds the whole one), random weights, every id decodable, tied as the original."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = json.loads((ROOT / "recipes" / "models" / "qwen3-0.6b" / "config.json").read_text())
    narrow = {**shape, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 16384}
    (tmp_path / "like").mkdir()
    (tmp_path / "like" / "config.json").write_text(json.dumps(narrow))
    molt_tiny(["--like", str(tmp_path / "like"), "--out", str(tmp_path / "model")])
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    same = ("num_hidden_layers", "hidden_size", "num_key_value_heads", "head_dim", "vocab_size", "rope_theta",
            "tie_word_embeddings", "max_position_embeddings")
    assert {k: config.get(k, config.get("rope_parameters", {}).get(k)) for k in same} == {k: narrow[k] for k in same}
    assert config["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert len(tokenizer) == 16384 and tokenizer.eos_token == "<|im_end|>"
    filler = [i for i in range(16384) if tokenizer.convert_ids_to_tokens(i).startswith("<|unused_")]
    assert len(filler) > 8000 and tokenizer.decode(filler[-1:]) == f"<|unused_{filler[-1]}|>"
    text = " ".join(f"word{i} <|unused_{i}|>" for i in filler[:50])  # the filler is never what text encodes to
    assert not set(tokenizer(text).input_ids) & set(filler)
