"""A byte-level BPE tokenizer with a ChatML chat template, built offline.

There is no model hub here, so the tiny models get a tokenizer trained on a
corpus this file generates deterministically (words, arithmetic, code, JSON
tool calls). Byte-level BPE is what the real policies use, which matters: a
decode followed by an encode is not the identity, and the tests must see that.

The chat template is ChatML with Qwen-style tools: a `# Tools` system block,
`<tool_call>{json}</tool_call>` in assistant turns, tool results as `tool`
turns wrapped in `<tool_response>`, and `<think>` reasoning. It is
prefix-stable: rendering a conversation and then appending a turn gives the
same text as rendering the longer conversation, which multi-turn stitching
relies on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Special tokens never split by BPE. Control tokens are "special" (dropped by
# decode(skip_special_tokens=True)); the markup tokens are kept in decoded text
# so that tool calls and reasoning stay parseable.
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
]

# How the chat template writes an image part (a vision-language tokenizer may choose its processor's token).
IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"

CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{- part.text -}}"
    "{%- elif part.type in ['image', 'image_url'] -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    # A system turn: the first system message and, when tools are given, their signatures.
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools or has_system -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- render(messages[0].content) -}}{%- endif -%}"
    "{%- if tools -%}"
    "{%- if has_system -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou can call these functions. Their signatures are inside <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object inside <tool_call></tool_call>:\\n'"
    " '<tool_call>\\n{\"name\": <function-name>, \"arguments\": <arguments-object>}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    # The conversation.
    "{%- for message in messages -%}"
    "{%- if not (loop.first and has_system) -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.reasoning_content -%}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- render(message.content) -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + render(message.content) + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# --------------------------------------------------------------------------
# Corpus: deterministic text that covers what the tiny models will read.

_WORDS = """
the a an and or but if then else when while for to of in on at by with from
is are was were be been being have has had do does did can could will would
should may might must shall not no yes it this that these those there here
what which who whom whose why how where answer question number numbers sum
add plus minus times divide equal equals result total count left right up
down higher lower guess again correct wrong try turn step game move goal hole
frozen lake ice grid cell start end player agent tool call code run output
error print value list string function return import def class true false
none python math solve problem think reason first second third next last one
two three four five six seven eight nine ten hundred thousand small large
shape shapes circle square triangle red green blue image picture color see
you your we our they their he she his her me my i user assistant system
hello please thanks good bad great target reach make use each only once
""".split()


def _corpus_lines(seed: int = 0, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        kind = rng.randrange(6)
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + ".")
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            value = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"What is {a} {op} {b}? The answer is {value}.")
        elif kind == 2:
            x = rng.randint(1, 100)
            lines.append(f"def f(x):\n    return x * {x} + {rng.randint(0, 9)}\n\nprint(f({rng.randint(0, 50)}))")
        elif kind == 3:
            code = f"print({rng.randint(1, 99)} {rng.choice('+-*')} {rng.randint(1, 99)})"
            call = {"name": rng.choice(["python", "search", "calculator"]), "arguments": {"code": code}}
            lines.append(json.dumps(call))
        elif kind == 4:
            lines.append(f"{rng.choice(['higher', 'lower', 'correct'])}! Guess a number between 1 and {rng.randint(10, 1000)}.")
        else:
            lines.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 _.,:;()[]{}\"'=<>!?/\\\n\t") for _ in range(40)))
    return lines


def _padded(tok, size: int):
    """`tok` with its BPE vocabulary filled up to `size` entries by tokens no merge makes."""
    from tokenizers import AddedToken, Tokenizer, models

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<|unused_{i}|>": i for i in range(len(vocab), size)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    padded = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    padded.pre_tokenizer, padded.decoder = tok.pre_tokenizer, tok.decoder
    padded.add_special_tokens([AddedToken(t["content"], special=True, normalized=False) for t in spec["added_tokens"]])
    return padded


# --------------------------------------------------------------------------
# Build


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1024, seed: int = 0,
                    image_tokens: tuple[str, ...] = (), image_text: str = IMAGE_TEXT, pad: bool = False):
    """Train the byte-level BPE tokenizer and save it (transformers format) to `out_dir`.

    `vocab_size` counts special tokens; it must be a multiple of 64 so the
    model's embedding matrix needs no padding rows. A vision-language model's
    processor may want its own special tokens (`image_tokens`) and its own
    image placeholder in the chat template (`image_text`). With `pad`, a
    vocabulary larger than the corpus yields (a real model's 151,936) is
    filled with `<|unused_N|>` entries that no text encodes to but every id
    decodes from, so a randomly initialised model of that shape can sample
    any id.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size % 64:
        raise ValueError(f"vocab_size={vocab_size} must be a multiple of 64")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS) - len(image_tokens),
        special_tokens=CONTROL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(seed), trainer=trainer)
    if pad:
        tok = _padded(tok, vocab_size - len(MARKUP_TOKENS) - len(image_tokens))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in image_tokens])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"the corpus yields {tok.get_vocab_size()} tokens, fewer than vocab_size={vocab_size}; "
            "lower vocab_size"
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=CONTROL_TOKENS + list(image_tokens),
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE.replace(IMAGE_TEXT, image_text)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast
