"""Saved rollouts: `--log.rollouts` keeps what the policy did, in RUN_DIR/rollouts/.

Every trained episode's segments, and every evaluation play's, as one JSON
line each: `Trajectory.to_dict()` (the schema of `molt-serve --trajectories`:
messages, token ids, mask, engine logprobs, versions, reward, env info) with
`step` (the step that trained it, or that the evaluation followed: 0 before
training) and `split` ("train" or "eval"; an evaluation play also has its
`episode` and `sample`). A training record also says whether it was trained
(`trained`: false when dynamic filtering or the staleness bound left it out),
with which `advantage`, and the trainer's logprob of each trained token under
the weights before the step (`trainer_logprobs`, None elsewhere; against the
engine's `logprobs`, the mismatch and staleness token by token). Images in
`messages` are PNG data: URLs.

Files are gzipped, one per `--log.rollouts_every` steps
(`steps_000001.jsonl.gz` holds steps 1 to N), each step appended as a gzip
member of its own: a run killed while writing loses that step's member at
most, and `read` stops at the last whole line. `--log.rollouts_groups K`
keeps the first K groups of each step, a bound for long runs.

`index.jsonl` beside the files has one line per member: its step, file, byte
offset and size, and a summary of each of its records (`summary`), so that a
reader finds a step's episodes without decompressing the others
(`read_member`). A resumed run first drops the steps its checkpoint does not
cover (written after the checkpoint, before the run stopped), rebuilds the
index from the files (`scan`), and appends from there: a file holds each step
once.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from molt_train.group import Group

INDEX = "index.jsonl"


def read(path: Path) -> Iterator[dict]:
    """The records of a file of saved rollouts, up to the last whole line (a half-written end is skipped)."""
    with gzip.open(path, "rt") as lines:
        try:
            yield from _whole_lines(lines)
        except (EOFError, gzip.BadGzipFile, zlib.error, json.JSONDecodeError):
            return


def _whole_lines(lines) -> Iterator[dict]:
    """Each line's JSON up to the first that is not whole (a writer's half-written end)."""
    for line in lines:
        if not line.endswith("\n"):
            return
        yield json.loads(line)


def read_member(path: Path, offset: int, size: int) -> list[dict]:
    """The records of one gzip member of a file (an index line's `offset` and `size`)."""
    with path.open("rb") as file:
        file.seek(offset)
        data = zlib.decompress(file.read(size), wbits=31)
    return [json.loads(line) for line in data.decode().splitlines()]


def members(path: Path) -> Iterator[tuple[int, int, list[dict]]]:
    """Each whole gzip member of a file: its byte offset, its size and its records (a torn end is skipped)."""
    data, offset = path.read_bytes(), 0
    while offset < len(data):
        inflate = zlib.decompressobj(wbits=31)
        try:
            text = inflate.decompress(data[offset:]).decode()
        except zlib.error:
            return
        if not inflate.eof:
            return
        size = len(data) - offset - len(inflate.unused_data)
        yield offset, size, [json.loads(line) for line in text.splitlines()]
        offset += size


def summary(record: dict) -> dict:
    """What an index keeps of a record: enough to list, sort and filter episodes without opening them."""
    info = {key: value for key, value in (record.get("info") or {}).items()
            if isinstance(value, (bool, int, float, str)) and not (isinstance(value, str) and len(value) > 80)}
    out = {"split": record["split"], "rollout_id": record["rollout_id"], "group_id": record["group_id"],
           "segment": record["segment"], "num_segments": record["num_segments"], "reward": record["reward"],
           "advantage": record.get("advantage"), "trained": record.get("trained", False),
           "tokens": len(record["token_ids"]), "generated": sum(record["mask"]), "truncated": record["truncated"],
           "finish_reason": record["finish_reason"], "info": info}
    if record["split"] == "eval":
        out |= {"episode": record["episode"], "sample": record["sample"]}
    return out | prompt(record.get("messages") or [])


def prompt(messages: list[dict]) -> dict:
    """An episode's opening, the messages before the first reply: `prompt_id`, the same for the same opening
    in any run or step (what `molt-view` compares), and `prompt`, the text of its last user message, cut."""
    opening = messages[:next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))]
    users = [m for m in opening if m.get("role") == "user"]
    content = users[-1].get("content") if users else ""
    text = content if isinstance(content, str) else " ".join(
        p.get("text", "") if p.get("type") == "text" else "[image]" for p in content or () if isinstance(p, dict))
    digest = hashlib.sha1(json.dumps(opening, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return {"prompt_id": digest, "prompt": text[:100]}


def index_line(step: int, file: str, offset: int, size: int, records: list[dict]) -> str:
    return json.dumps({"step": step, "file": file, "offset": offset, "size": size,
                       "records": [summary(record) for record in records]}) + "\n"


def scan(directory: Path) -> list[dict]:
    """The index of a directory of saved rollouts, built from its files (a run from before indexes, or one
    whose index is behind its files)."""
    return [json.loads(index_line(records[0]["step"], path.name, offset, size, records))
            for path in sorted(directory.glob("steps_*.jsonl.gz"))
            for offset, size, records in members(path) if records]


def load_index(directory: Path) -> list[dict]:
    """`index.jsonl`'s entries up to its last whole line; built from the files when there is none."""
    path = directory / INDEX
    if not path.exists():
        return scan(directory)
    with path.open() as lines:
        return list(_whole_lines(lines))


class RolloutLog:
    def __init__(self, run_dir: Path, log, resume_step: int = 0):
        """`log`: the run's `LogConfig`; `resume_step`: the step of the checkpoint a resumed run starts from."""
        self.dir, self.every, self.groups = run_dir / "rollouts", log.rollouts_every, log.rollouts_groups
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.dir.glob("steps_*.jsonl.gz")):
            records = list(read(path))
            kept = [record for record in records if record["step"] <= resume_step]
            if len(kept) == len(records):
                continue
            if kept:
                partial = path.with_suffix(".partial")
                with partial.open("wb") as out:
                    for step in sorted({record["step"] for record in kept}):
                        out.write(_member([record for record in kept if record["step"] == step]))
                partial.replace(path)
            else:
                path.unlink()
        index = self.dir / INDEX
        partial = index.with_suffix(".partial")
        partial.write_text("".join(json.dumps(entry) + "\n" for entry in scan(self.dir)))
        partial.replace(index)

    def write(self, step: int, groups: list[Group], plays: list[dict] | None = None,
              trained: dict[str, dict] | None = None) -> None:
        """A step's trained groups (the first `rollouts_groups`), and the evaluation `plays` that followed it
        (their records as the rollout workers return them, with `trajectories`). `trained`: what the trainer
        did with each trained segment, by `(rollout_id, segment)` as `batch.segment_key` writes it: its
        `advantage` and `trainer_logprobs`."""
        from molt_train.batch import segment_key

        trained = trained or {}
        records = [{"step": step, "split": "train", **trajectory.to_dict(), "trained": False, "advantage": None,
                    "trainer_logprobs": None, **trained.get(segment_key(trajectory), {})}
                   for group in groups[:self.groups or None] for trajectory in group.trajectories]
        records += [{"step": step, "split": "eval", "episode": play["episode"], "sample": play["sample"], **trajectory}
                    for play in plays or () for trajectory in play["trajectories"]]
        for record in records:
            if record.get("messages"):
                record["messages"] = viewable(record["messages"])
        if records:
            path = self.path(step)
            offset = path.stat().st_size if path.exists() else 0
            member = _member(records)
            with path.open("ab") as out:  # a gzip member per step
                out.write(member)
            with (self.dir / INDEX).open("a") as out:
                out.write(index_line(step, path.name, offset, len(member), records))

    def path(self, step: int) -> Path:
        first = (max(step, 1) - 1) // self.every * self.every + 1
        return self.dir / f"steps_{first:06d}.jsonl.gz"


def viewable(messages: list[dict]) -> list[dict]:
    """Chat messages with their images (PIL images, HxWx3 arrays) as PNG data: URLs."""
    def part(value):
        if isinstance(value, dict) and value.get("type") == "image" and not isinstance(value.get("image"), str):
            return {**value, "image": data_url(value["image"])}
        return value

    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages]


def data_url(image) -> str:
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(image)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _member(records: list[dict]) -> bytes:
    return gzip.compress("".join(json.dumps(record, default=_plain) + "\n" for record in records).encode(), mtime=0)


def _plain(value):
    """What an environment's info or an observation may hold that JSON does not: numpy values as numbers and
    lists, anything else named by its type."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return f"<{type(value).__name__}>"
