"""Supervised fine-tuning data: chat conversations and trajectory records as token ids and a loss mask.

Chat conversations are trained on their assistant replies, found with the model's own chat template rather than
with markers: reply i is what rendering `messages[:i+1]` adds to the generation prompt of `messages[:i]`, less
the whitespace at its end. So the end-of-turn token is trained (the model learns to stop) and the newline after
it is not. A token is trained when its first character lies in a reply. Where each turn renders as a prefix of
the whole conversation, one sequence holds every reply; a template that rewrites history (Qwen3 drops the
`<think>` block of earlier turns once a user speaks again) gets one sequence per assistant turn instead, the
context as the model saw it when it replied.

A conversation with images (OpenAI `image_url` parts, data: URLs) is rendered with one placeholder per image and
each placeholder expanded by the model's own processor (`molt_agents.multimodal.Vision`), as the env runner and
the loopback do; the image tokens are never trained and their tensors go to the forward.

Trajectory records (`molt_env.trajectory`) are trained token-exact on their own mask. `min_reward` and
`best_of_group` select rollouts for rejection-sampling fine-tuning; evaluation plays are never trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from molt_agents.chat_template import render_text
from molt_agents.multimodal import chat_images, collapse, for_template, is_image_part, join_images
from molt_env.trajectory import Trajectory, check
from molt_train import saved_rollouts

KINDS = ("auto", "chat", "trajectories")


@dataclass
class Example:
    token_ids: list[int]
    mask: list[int]  # 1 where the token is trained, 0 elsewhere; same length as token_ids
    source: str  # "<file>:<line>" (1-based) of the record it came from, for error messages
    images: dict | None = None  # a trajectory's image tensors (`Trajectory.mm`), for the forward
    routes: object = None  # a trajectory's expert routes, replayed as in RL


# --------------------------------------------------------------------------
# Chat conversations


def chat_examples(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                  last_turn_only: bool = False, source: str = "", vision=None) -> list[Example]:
    """The conversation with its assistant replies trained: one Example, or one per reply where the template
    rewrites earlier turns (see the module docstring). Images need the model's `vision` (a `Vision`)."""
    turns = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
    if not turns:
        raise ValueError(f"{source}: the conversation has no assistant message to train on")
    pictures = []
    if any(isinstance(m.get("content"), list) and any(map(is_image_part, m["content"])) for m in messages):
        if vision is None:
            raise ValueError(f"{source}: the conversation holds images and the model has no image processor")
        try:
            pictures = chat_images(messages)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None
        messages = for_template(messages)
    replies = []  # (the text up to and with reply i, the reply's character span in it)
    for i in turns[-1:] if last_turn_only else turns:
        prompt = render_text(tokenizer, messages[:i], tools, add_generation_prompt=True)
        upto = render_text(tokenizer, messages[:i + 1], tools, add_generation_prompt=False)
        if not upto.startswith(prompt):
            raise ValueError(f"{source}: assistant turn {i}: the chat template renders the reply differently from "
                             "its generation prompt, so the reply cannot be located in the text")
        replies.append((upto, (len(prompt), max(len(prompt), len(upto.rstrip())))))
    full = render_text(tokenizer, messages, tools, add_generation_prompt=False)
    if all(full.startswith(upto) for upto, _ in replies):
        return [_example(tokenizer, full, [span for _, span in replies], source, vision, pictures)]
    return [_example(tokenizer, upto, [span], source, vision, pictures) for upto, span in replies]


def _example(tokenizer, text: str, spans: list[tuple[int, int]], source: str, vision, pictures: list) -> Example:
    # Tokenized as the env runner does (`encode(text, add_special_tokens=False)`), with character offsets.
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    mask = [int(any(begin <= start < end for begin, end in spans)) for start, _ in encoding["offset_mapping"]]
    shown = text.count(vision.image_token) if vision is not None else 0  # the images this text has reached
    if not shown:
        return Example(ids, mask, source)
    expanded, images, tensors = vision.encode(text, pictures[:shown])
    if collapse(expanded, images, vision.placeholder_id) != ids:
        raise ValueError(f"{source}: the processor tokenizes the text around the images differently from the "
                         "tokenizer, so the replies cannot be located")
    wide, image = [], 0  # the mask with each placeholder widened to its image's span, never trained
    for token, trained in zip(ids, mask):
        if token == vision.placeholder_id:
            wide += [0] * images[image][1]
            image += 1
        else:
            wide.append(trained)
    return Example(expanded, wide, source, join_images(tensors))


# --------------------------------------------------------------------------
# Trajectory records


def trajectory_examples(records: list[dict], min_reward: float | None = None,
                        best_of_group: bool = False) -> list[Example]:
    """The records' own tokens and masks; `min_reward` keeps rollouts with `reward >= min_reward`,
    `best_of_group` the highest-rewarded rollout of each group (the first on ties), all its segments."""
    return _trajectory_examples([(f"record {i}", record) for i, record in enumerate(records)], min_reward,
                                best_of_group)


def _trajectory_examples(located: list[tuple[str, dict]], min_reward: float | None,
                         best_of_group: bool) -> list[Example]:
    kept = []
    for source, record in located:
        if record.get("split") == "eval":
            continue
        try:
            trajectory = Trajectory.from_dict(record)
            check(trajectory)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{source}: not a valid trajectory record: {error}") from error
        if best_of_group and not (trajectory.group_id and trajectory.rollout_id):
            raise ValueError(f"{source}: best_of_group needs a group_id and a rollout_id on every record")
        kept.append((source, trajectory))
    if best_of_group:
        best = {}  # group_id -> (rollout_id, reward) of its best rollout so far
        for _, t in kept:
            if t.group_id not in best or t.reward > best[t.group_id][1]:
                best[t.group_id] = (t.rollout_id, t.reward)
        kept = [(source, t) for source, t in kept if best[t.group_id][0] == t.rollout_id]
    if min_reward is not None:
        kept = [(source, t) for source, t in kept if t.reward >= min_reward]
    return [Example(t.token_ids, t.mask, source, t.mm["tensors"] if t.mm else None, t.routes) for source, t in kept]


# --------------------------------------------------------------------------
# Files


def load_examples(path: str | Path, tokenizer, kind: str = "auto", last_turn_only: bool = False,
                  min_reward: float | None = None, best_of_group: bool = False, vision=None) -> list[Example]:
    """The examples of a `.jsonl` / `.jsonl.gz` file, or of every such file in a directory (by name), e.g. a
    run's `rollouts/`. `kind` "auto" reads each file's first record: `token_ids` makes it trajectories,
    `messages` chat. The filters apply to trajectory records, pooled across files. `vision`: the model's
    processor, for chats with images."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: choose one of {', '.join(KINDS)}")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    files = sorted(p for p in path.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz"))) if path.is_dir() else [path]
    filters = [f"min_reward={min_reward}"] * (min_reward is not None) + ["best_of_group"] * best_of_group
    chats, trajectories = [], []
    for file in files:
        records = _records(file)
        file_kind = kind if kind != "auto" or not records else _kind(*records[0])
        if file_kind == "chat" and records and filters:
            raise ValueError(f"{file}: {' and '.join(filters)} select trajectory records; this file holds chats")
        for source, record in records:
            if file_kind == "trajectories":
                trajectories.append((source, record))
            elif "messages" not in record:
                raise ValueError(f"{source}: a chat record needs 'messages'")
            else:
                chats += chat_examples(tokenizer, record["messages"], record.get("tools"), last_turn_only, source,
                                       vision)
    examples = chats + _trajectory_examples(trajectories, min_reward, best_of_group)
    if not examples:
        after = f" after the filters {', '.join(filters)}" if filters else ""
        raise ValueError(f"{path}: no examples were left{after}")
    return examples


def _records(file: Path) -> list[tuple[str, dict]]:
    """`(source, record)` for each line; a gzipped file up to its last whole line (a run may be writing it)."""
    if file.name.endswith(".gz"):
        return [(f"{file}:{line}", record) for line, record in enumerate(saved_rollouts.read(file), 1)]
    located = []
    for line, text in enumerate(file.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{file}:{line}: not a JSON line: {error}") from error
        if not isinstance(record, dict):
            raise ValueError(f"{file}:{line}: a record is a JSON object, not {type(record).__name__}")
        located.append((f"{file}:{line}", record))
    return located


def _kind(source: str, record: dict) -> str:
    if "token_ids" in record:
        return "trajectories"
    if "messages" in record:
        return "chat"
    raise ValueError(f"{source}: neither a chat record ('messages') nor a trajectory record ('token_ids')")
