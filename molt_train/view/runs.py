"""What `molt-view` reads of a run directory: its metrics, its saved rollouts' index, one episode, its tokenizer.

A run may still be writing: `metrics.jsonl` and `rollouts/index.jsonl` are
read as tails (`JsonLines`): each request reads only the whole lines added
since the last one, and the whole file again when a resumed run replaced or
cut it. The index is kept as raw lines by step and parsed for a step when
that step is first asked for, so a run of a thousand steps opens without
parsing a hundred thousand summaries. An episode is read from the one gzip
member (`saved_rollouts.read_member`) that its index line points at; only
file names the index gives, that are plain `steps_*.jsonl.gz` names, are
opened, and only inside the run's `rollouts/`.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

import yaml

from molt_train import saved_rollouts

ROLLOUT_FILE = re.compile(r"steps_\d+\.jsonl\.gz")
STEP_PREFIX = re.compile(r'\{"step": (\d+), ')  # how `saved_rollouts.index_line` begins a line
SORT_KEYS = ("group", "reward", "advantage", "tokens", "generated", "segments")
MEMBERS_KEPT = 8  # decompressed gzip members kept per run: moving between episodes of a step reads none again


class NotFound(LookupError):
    """A step, an episode or a file that the run does not have; `parameter` names the request's part at fault."""

    def __init__(self, parameter: str, message: str):
        super().__init__(message)
        self.parameter = parameter


class BadRequest(ValueError):
    def __init__(self, parameter: str, message: str):
        super().__init__(message)
        self.parameter = parameter


class JsonLines:
    """A JSON-lines file another process appends to. `read` returns the lines completed since the last call (a
    half-written last line waits for the next) and whether the file was replaced or rewritten since (a resumed
    run rewrites it): then the lines are all of the file's, to replace what was read before."""

    def __init__(self, path: Path):
        self.path, self.offset, self.inode = path, 0, None

    def read(self) -> tuple[bool, list[str]]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            replaced = self.offset > 0
            self.offset, self.inode = 0, None
            return replaced, []
        with self.path.open("rb") as file:
            # rewritten in place when the byte before where we stopped no longer ends a line
            cut = self.offset > 0 and os.pread(file.fileno(), 1, self.offset - 1) != b"\n"
            replaced = self.inode is not None and (stat.st_ino != self.inode or stat.st_size < self.offset or cut)
            if replaced:
                self.offset = 0
            self.inode = stat.st_ino
            file.seek(self.offset)
            data = file.read(stat.st_size - self.offset)
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        return replaced, whole.decode(errors="replace").splitlines()


def _entry(line: str | dict) -> dict | None:
    """An index line as `saved_rollouts.index_line` writes it, or None for one that is not (a line cut by a
    crash that a later write ran on from)."""
    entry = line if isinstance(line, dict) else _loads(line)
    if entry is None or not isinstance(entry.get("records"), list) or not all(
            isinstance(entry.get(key), int) for key in ("step", "offset", "size")):
        return None
    return entry


def _loads(line: str) -> dict | None:
    """A JSON object, or None for a line that is not one (the tail of a file rewritten under the reader)."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


class Run:
    """One run directory, addressed by the page as its place on `molt-view`'s command line."""

    def __init__(self, directory: Path, name: str):
        self.dir, self.name = directory, name
        self.rollouts = directory / "rollouts"
        config = directory / "config.yaml"
        loaded = yaml.safe_load(config.read_text()) if config.is_file() else None
        self.config = loaded if isinstance(loaded, dict) else {}
        self._lock = threading.RLock()
        self._metrics_file = JsonLines(directory / "metrics.jsonl")
        self._index_file = JsonLines(self.rollouts / saved_rollouts.INDEX)
        self._scanned: tuple | None = None  # the files a run without an index file was last scanned at
        self._metrics: dict[int, dict] = {}
        self._metric_keys: set[str] = set()  # those with a number at some step: the curves there are
        self._index: dict[int, list[str | dict]] = {}  # step -> its index lines (str until parsed)
        self._episodes: dict[int, tuple[int, list[dict]]] = {}  # step -> (its index lines, its episode rows)
        self._members: OrderedDict[tuple[str, int], list[dict]] = OrderedDict()
        self._tokenizer = None

    # ------------------------------------------------------------------
    # the tails: metrics and index

    def refresh(self) -> None:
        """Read what the run appended since the last request."""
        with self._lock:
            replaced, lines = self._metrics_file.read()
            if replaced:
                self._metrics, self._metric_keys = {}, set()
            for line in lines:
                record = _loads(line)
                if record is not None and isinstance(record.get("step"), int):
                    self._metrics[record["step"]] = record
                    self._metric_keys.update(key for key, value in record.items() if key != "step" and _number(value))
            if self._index_file.path.exists() or not self.rollouts.is_dir():
                replaced, lines = self._index_file.read()
                if replaced:
                    self._forget_index()
                for line in lines:
                    match = STEP_PREFIX.match(line)
                    step = int(match.group(1)) if match else (_loads(line) or {}).get("step")
                    if isinstance(step, int):
                        self._index.setdefault(step, []).append(line)
            else:  # a run from before indexes: its files scanned, again when they grow
                files = tuple((p.name, p.stat().st_size) for p in sorted(self.rollouts.glob("steps_*.jsonl.gz")))
                if files != self._scanned:
                    self._forget_index()
                    for entry in saved_rollouts.load_index(self.rollouts):
                        self._index.setdefault(entry["step"], []).append(entry)
                    self._scanned = files

    def _forget_index(self) -> None:
        self._index, self._episodes, self._members = {}, {}, OrderedDict()

    def summary(self) -> dict:
        with self._lock:
            return {"name": self.name, "env": self.config.get("env"), "model": self.config.get("model"),
                    "steps": self.config.get("steps"), "last_step": max(self._metrics, default=None),
                    "metric_keys": sorted(self._metric_keys), "rollout_steps": sorted(self._index)}

    def series(self, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
        """Each metric's (step, value) points, where the step logged a number for it."""
        with self._lock:
            return {key: [(step, record[key]) for step, record in sorted(self._metrics.items())
                          if _number(record.get(key))] for key in keys}

    def held_version(self, step: int, split: str) -> int | None:
        """The policy version the step's tokens are measured against: the trainer's before the step for what it
        trained, the engines' after it for an evaluation (`version` in the metrics, 0 before the first)."""
        with self._lock:
            at = step - 1 if split == "train" else step
            version = self._metrics.get(at, {}).get("version")
            if isinstance(version, int):
                return version
            return 0 if at <= 0 else None

    # ------------------------------------------------------------------
    # a step's episodes

    def episodes(self, step: int) -> list[dict]:
        """A step's episodes, one row per rollout (its segments' summaries joined), with where its records are."""
        with self._lock:
            lines = self._index.get(step)
            if not lines:
                raise NotFound("step", f"step {step}: no saved rollouts (steps with rollouts: "
                                       f"{_ranges(sorted(self._index)) or 'none yet'})")
            cached = self._episodes.get(step)
            if cached and cached[0] == len(lines):
                return cached[1]
            entries = [entry for entry in map(_entry, lines) if entry is not None]
            self._index[step] = lines = entries
            rows: dict[str, dict] = {}
            for place, entry in enumerate(entries):
                records = entry["records"]
                prompts = self._prompts(entry) if any("prompt_id" not in r for r in records) else None
                for line, record in enumerate(records):
                    if prompts:
                        record = record | prompts[line]
                    row = rows.get(record["rollout_id"])
                    if row is None:
                        rows[record["rollout_id"]] = _row(record, (place, line))
                    else:
                        _join(row, record, (place, line))
            episodes = list(rows.values())
            self._episodes[step] = (len(lines), episodes)
            return episodes

    def _prompts(self, entry: dict) -> list[dict]:
        """`prompt_id` and `prompt` of a member's records, for an index written before it kept them."""
        return [saved_rollouts.prompt(record.get("messages") or []) for record in self._member(entry)]

    def episode(self, step: int, rollout_id: str) -> dict:
        """One episode: its row and its segments' records, in order."""
        with self._lock:
            row = next((r for r in self.episodes(step) if r["rollout_id"] == rollout_id), None)
            if row is None:
                raise NotFound("rollout", f"step {step} has no episode {rollout_id!r}")
            entries = self._index[step]
            members = [self._member(entries[place]) for place, _ in row["where"]]
            if any(line >= len(member) for member, (_, line) in zip(members, row["where"])):
                raise NotFound("rollout", f"step {step}: episode {rollout_id!r} is in the index but not in its file "
                                          "(the file was rewritten after the index was read)")
            records = [member[line] for member, (_, line) in zip(members, row["where"])]
            return {"row": row, "records": sorted(records, key=lambda record: record.get("segment", 0))}

    def _member(self, entry: dict) -> list[dict]:
        name = entry.get("file")
        if not isinstance(name, str) or not ROLLOUT_FILE.fullmatch(name):
            raise NotFound("step", f"step {entry.get('step')}: the index names {name!r}, not a file of saved "
                                   "rollouts (steps_NNNNNN.jsonl.gz)")
        key = (name, entry["offset"])
        if key in self._members:
            self._members.move_to_end(key)
            return self._members[key]
        path = self.rollouts / name
        if not path.is_file():
            raise NotFound("step", f"step {entry['step']}: its file {name} is missing from {self.rollouts}")
        try:
            records = saved_rollouts.read_member(path, entry["offset"], entry["size"])
        except (OSError, zlib.error, ValueError) as error:  # ValueError: a line that is not JSON
            raise NotFound("step", f"step {entry['step']}: its records in {name} are unreadable ({error})") from None
        self._members[key] = records
        if len(self._members) > MEMBERS_KEPT:
            self._members.popitem(last=False)
        return records

    # ------------------------------------------------------------------
    # tokens as text

    def tokenizer(self):
        """The run's tokenizer (`tokenizer.json` of its latest checkpoint, else of its model directory), loaded
        on first use; None until there is one."""
        with self._lock:
            if self._tokenizer is None:
                from tokenizers import Tokenizer  # the Rust tokenizer alone: transformers is slow to import

                checkpoints = sorted((self.dir / "checkpoints").glob("step_*/policy/tokenizer.json"))
                model = self.config.get("model")
                candidates = checkpoints[-1:] + ([Path(model) / "tokenizer.json"] if isinstance(model, str) else [])
                path = next((p for p in candidates if p.is_file()), None)
                if path is not None:
                    self._tokenizer = Tokenizer.from_file(str(path))
            return self._tokenizer

    def pieces(self, token_ids: list[int]) -> list[str] | None:
        """Each token's text, decoded alone (a byte of a longer character shows as �); None without a tokenizer."""
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return None
        return tokenizer.decode_batch([[token] for token in token_ids], skip_special_tokens=False)


# ----------------------------------------------------------------------
# episode rows: list, filter, sort, page


def _row(record: dict, where: tuple[int, int]) -> dict:
    eval_play = record["split"] == "eval"
    return {"rollout_id": record["rollout_id"], "split": record["split"],
            "group": f"eval {record.get('episode')}" if eval_play else str(record["group_id"]),
            "group_id": record["group_id"], "reward": record["reward"], "advantage": record.get("advantage"),
            "trained": bool(record.get("trained")), "tokens": record["tokens"], "generated": record["generated"],
            "segments": 1, "truncated": bool(record["truncated"]), "finish_reason": record["finish_reason"],
            "info": record.get("info") or {}, "prompt_id": record.get("prompt_id"), "prompt": record.get("prompt"),
            **({"episode": record.get("episode"), "sample": record.get("sample")} if eval_play else {}),
            "where": [where], "last_segment": record["segment"]}


def _join(row: dict, record: dict, where: tuple[int, int]) -> None:
    """A further segment of a row's episode: lengths add up; the episode's end speaks for the whole."""
    row["tokens"] += record["tokens"]
    row["generated"] += record["generated"]
    row["segments"] += 1
    row["trained"] = row["trained"] or bool(record.get("trained"))
    row["where"].append(where)
    if record["segment"] >= row["last_segment"]:
        row["last_segment"] = record["segment"]
        row |= {"truncated": bool(record["truncated"]), "finish_reason": record["finish_reason"],
                "info": record.get("info") or {}}
    if row["advantage"] is None:
        row["advantage"] = record.get("advantage")


def info_keys(rows: list[dict]) -> list[str]:
    return sorted({key for row in rows for key in row["info"]})


def select(rows: list[dict], *, split: str | None = None, truncated: bool | None = None,
           trained: bool | None = None, min_reward: float | None = None, max_reward: float | None = None,
           info: list[str] = (), q: str | None = None, prompt_id: str | None = None) -> list[dict]:
    """The rows that pass every filter given; `info`: "KEY=VALUE" each (VALUE as JSON writes it, or as text)."""
    known = set(info_keys(rows))
    wanted = []
    for condition in info:
        key, equals, value = condition.partition("=")
        if not equals:
            raise BadRequest("info", f"info={condition!r}: write KEY=VALUE, e.g. info=called=true")
        if key not in known:
            raise BadRequest("info", f"info={condition!r}: no episode of this step has info field {key!r} "
                                     f"(fields: {', '.join(sorted(known)) or 'none'})")
        wanted.append((key, value))
    text = q.lower() if q else None
    return [row for row in rows
            if (split is None or row["split"] == split)
            and (truncated is None or row["truncated"] == truncated)
            and (trained is None or row["trained"] == trained)
            and (min_reward is None or row["reward"] >= min_reward)
            and (max_reward is None or row["reward"] <= max_reward)
            and (prompt_id is None or row["prompt_id"] == prompt_id)
            and (text is None or text in (row["prompt"] or "").lower())
            and all(key in row["info"] and value in (json.dumps(row["info"][key]), str(row["info"][key]))
                    for key, value in wanted)]


def order(rows: list[dict], sort: str, descending: bool) -> list[dict]:
    """Rows sorted by `sort` (one of `SORT_KEYS` or `info.KEY`); rows without a value go last either way.
    `group` keeps a prompt group's episodes together: train groups by id, then evaluation episodes."""
    if sort == "group":
        def key(row):
            return (row["split"] == "eval", _natural(row["group"]), _natural(row["rollout_id"]))

        return sorted(rows, key=key, reverse=descending)
    if sort.startswith("info."):
        field = sort[len("info."):]
        if field not in info_keys(rows):
            raise BadRequest("sort", f"sort={sort}: no episode of this step has info field {field!r}")

        def value(row):
            return row["info"].get(field)
    elif sort in SORT_KEYS:
        def value(row):
            return row[sort]
    else:
        raise BadRequest("sort", f"sort={sort}: sort by one of {', '.join(SORT_KEYS)} or info.KEY")
    present = [row for row in rows if _sortable(value(row))]
    missing = [row for row in rows if not _sortable(value(row))]
    kind = {type(value(row)) in (bool, int, float) for row in present}
    if len(kind) > 1:  # numbers and text in one field: compare as text
        return sorted(present, key=lambda row: str(value(row)), reverse=descending) + missing
    return sorted(present, key=value, reverse=descending) + missing


def group_stats(rows: list[dict]) -> dict[str, dict]:
    """Each prompt group's size and mean reward, over the rows given."""
    groups: dict[str, list[float]] = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row["reward"])
    return {group: {"episodes": len(rewards), "mean_reward": sum(rewards) / len(rewards)}
            for group, rewards in groups.items()}


def _natural(text: str) -> tuple:
    """"eval 10" after "eval 9", "16-10" after "16-9"."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part)


def _sortable(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ranges(steps: list[int]) -> str:
    """"0, 2-5, 9": a list of steps, short."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


# ----------------------------------------------------------------------
# an episode as the page shows it

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def conversation(messages: list[dict]) -> list[dict]:
    """Chat messages as the page shows them: content as text and image parts, and the tool calls, whether the
    message carries them (`tool_calls`, OpenAI style) or writes them in its text (`<tool_call>` blocks,
    Qwen/Hermes style)."""
    shown = []
    for message in messages:
        parts = _parts(message.get("content"))
        calls = [_call(call.get("function") or {}, call.get("id")) for call in message.get("tool_calls") or ()
                 if isinstance(call, dict)]
        if message.get("role") == "assistant":
            parts, written = _written_calls(parts)
            calls += written
        shown.append({"role": str(message.get("role", "?")), "parts": parts, "tool_calls": calls,
                      **{key: str(message[key]) for key in ("name", "tool_call_id") if message.get(key)}})
    return shown


def _parts(content) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for part in content if isinstance(content, list) else [content]:
        kind = part.get("type") if isinstance(part, dict) else None
        url = (part.get("image") if kind == "image" else
               (part.get("image_url") or {}).get("url") if kind == "image_url" else None)
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif isinstance(url, str) and url.startswith("data:image/"):
            parts.append({"type": "image", "url": url})
        elif kind in ("image", "image_url"):  # the page shows what the run holds, never a remote file
            parts.append({"type": "text", "text": f"[image not saved in the run: {str(url)[:200]}]"})
        else:
            parts.append({"type": "text", "text": json.dumps(part, default=str)})
    return parts


def _written_calls(parts: list[dict]) -> tuple[list[dict], list[dict]]:
    """Text parts with their `<tool_call>` blocks taken out, and those blocks as calls."""
    kept, calls = [], []
    for part in parts:
        if part["type"] != "text" or "<tool_call>" not in part["text"]:
            kept.append(part)
            continue
        for block in TOOL_CALL.findall(part["text"]):
            try:
                call = json.loads(block)
            except json.JSONDecodeError:
                call = None
            if isinstance(call, dict):
                calls.append(_call(call, None))
            else:
                calls.append({"id": None, "name": None, "arguments": block, "error": "not a JSON tool call"})
        rest = TOOL_CALL.sub("", part["text"]).strip()
        if rest:
            kept.append({"type": "text", "text": rest})
    return kept, calls


def _call(function: dict, call_id) -> dict:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {"id": call_id, "name": function.get("name"), "arguments": arguments}
    text = json.dumps(arguments)
    return {"id": call_id, "name": function.get("name"),
            "arguments": text if len(text) <= 80 else json.dumps(arguments, indent=1)}
