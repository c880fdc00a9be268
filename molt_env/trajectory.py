"""`Trajectory`: the one record that crosses from rollout to training.

One trajectory is one segment of a rollout: a token sequence exactly as the
engine saw and produced it. Tokens with `mask == 1` were sampled by the
engine and are the only ones trained; each carries the engine's logprob and
the weight version that sampled it. A rollout whose history was rewritten
(context compaction, a template that drops old reasoning) has several
segments; they share the rollout's reward and count once in group baselines.

`validate` checks the invariant before a trajectory enters the training
queue and names what is wrong with a reason code that metrics count.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np


@dataclass
class Trajectory:
    token_ids: list[int]  # the whole sequence, prompt and generations, as the engine saw it
    logprobs: list[float | None]  # engine sampling logprob where mask == 1, None elsewhere
    mask: list[int]  # 1 where the policy sampled the token (trained), 0 for prompt / env / tool tokens
    versions: list[int]  # engine weight version that sampled the token where mask == 1, -1 elsewhere
    reward: float = 0.0  # the rollout's return, shared by all its segments
    rollout_id: str = ""
    group_id: str = ""  # rollouts of the same prompt, for group baselines
    segment: int = 0  # index of this segment in its rollout
    num_segments: int = 1
    finish_reason: str = ""  # of the last generation: "stop", "length", "tool_calls"
    truncated: bool = False  # the episode hit a turn or length budget
    routes: np.ndarray | None = None  # optional int16 [T, layers, top_k] expert ids, -1 where unknown
    mm: dict | None = None  # optional images: see `MultiModal` below
    info: dict[str, Any] = field(default_factory=dict)  # episode facts: the env's last info, step rewards, task
    messages: list[dict] | None = None  # the episode's chat messages, last reply included, where kept (saved
    #                                    rollouts, molt-serve); for people and reward models, never trained on

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_trainable(self) -> int:
        return sum(self.mask)

    # ------------------------------------------------------------------
    # JSON lines

    def to_dict(self) -> dict:
        record = asdict(self)
        if self.routes is not None:
            routes = np.ascontiguousarray(self.routes, dtype=np.int16)
            record["routes"] = {"shape": list(routes.shape),
                                "int16_base64": base64.b64encode(routes.tobytes()).decode()}
        if self.mm is not None:
            record["mm"] = {**self.mm, "tensors": {k: _encode(v) for k, v in self.mm["tensors"].items()}}
        return record

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=_plain)

    @classmethod
    def from_dict(cls, record: dict) -> Trajectory:
        """A trajectory from `to_dict`'s record; other keys (where a file says it came from: `session`,
        `step`, `split`) are left out."""
        record = {key: value for key, value in record.items() if key in _FIELDS}
        routes = record.get("routes")
        if routes is not None:
            data = np.frombuffer(base64.b64decode(routes["int16_base64"]), dtype=np.int16)
            record["routes"] = data.reshape(routes["shape"]).copy()
        mm = record.get("mm")
        if mm is not None:
            record["mm"] = {**mm, "tensors": {k: _decode(v) for k, v in mm["tensors"].items()}}
        return cls(**record)

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        return cls.from_dict(json.loads(line))


_FIELDS = {f.name for f in fields(Trajectory)}


def _plain(value):
    """JSON for the numpy values environments tend to put in `info`."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} in a trajectory is not JSON serializable")


# --------------------------------------------------------------------------
# Validation

class InvalidTrajectory(ValueError):
    """A trajectory that breaks the token-first invariant; `reason` is a short code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# Multimodal: `mm` holds what the model's processor produced for the images of this sequence,
#   {"placeholder_id": int,            the image token the chat template writes and the processor repeats
#    "spans": [[start, length], ...],  each image's expanded tokens in token_ids, in order: its run of
#                                      placeholders, with the markers around them where the processor adds
#                                      some (Idefics3: <fake_token_around_image><global-img>...)
#    "tensors": {name: np.ndarray}}    the forward's image arguments (e.g. pixel_values [images, C, H, W];
#                                      pixel_values [patches, dim] with image_grid_thw [images, 3];
#                                      pixel_values [1, tiles, C, H, W] with pixel_attention_mask)
# The placeholders stay in token_ids exactly as the engine saw them; the tensors travel beside them.


def _encode(array: np.ndarray) -> dict:
    array = np.ascontiguousarray(array)
    return {"dtype": str(array.dtype), "shape": list(array.shape), "base64": base64.b64encode(array.tobytes()).decode()}


def _decode(record: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(record["base64"]), dtype=record["dtype"]).reshape(record["shape"]).copy()


def _check_mm(mm, token_ids: list[int]) -> str | None:
    """What is wrong with `mm` for these tokens, or None."""
    if not isinstance(mm, dict) or not {"placeholder_id", "spans", "tensors"} <= set(mm):
        return "mm needs placeholder_id, spans and tensors"
    spans, tensors, placeholder = mm["spans"], mm["tensors"], mm["placeholder_id"]
    covered, end = 0, 0
    for start, length in spans:
        if start < end or length < 1 or start + length > len(token_ids):
            return f"span {[start, length]} is outside the {len(token_ids)} tokens or overlaps the one before"
        if placeholder not in token_ids[start: start + length]:
            return f"span {[start, length]} holds no placeholder {placeholder}"
        covered += sum(t == placeholder for t in token_ids[start: start + length])
        end = start + length
    if sum(t == placeholder for t in token_ids) != covered:
        return "placeholder tokens outside the spans"
    pixels = tensors.get("pixel_values")
    if pixels is None:
        return "no pixel_values"
    grid = tensors.get("image_grid_thw")
    if pixels.ndim >= 5:  # [1, tiles, C, H, W]: one or more tiles per image
        if pixels.shape[0] != 1 or pixels.shape[1] < len(spans):
            return f"{len(spans)} placeholder spans for pixel_values of shape {list(pixels.shape)}"
        return None
    images = len(grid) if grid is not None else len(pixels)
    if images != len(spans):
        return f"{len(spans)} placeholder spans for {images} images"
    if grid is not None and int(np.prod(grid, axis=1).sum()) != len(pixels):
        return f"image_grid_thw covers {int(np.prod(grid, axis=1).sum())} patches, pixel_values has {len(pixels)}"
    return None


REASONS = (
    "empty",                      # no tokens at all
    "length_mismatch",            # logprobs / mask / versions not aligned with token_ids
    "bad_token_id",               # a token id that is not a non-negative int
    "bad_mask",                   # a mask value other than 0 or 1
    "no_trainable_tokens",        # nothing the policy sampled
    "first_token_trainable",      # token 0 has no context to be predicted from
    "trainable_without_logprob",  # a sampled token with no (or an impossible) engine logprob
    "trainable_without_version",  # a sampled token with no engine weight version
    "routes_mismatch",            # routes not [T, layers, top_k] int16 for these tokens
    "mm_mismatch",                # image placeholders and image tensors do not agree
    "bad_reward",                 # reward not a finite number
)


def check(trajectory: Trajectory) -> None:
    """Raise `InvalidTrajectory` if `trajectory` breaks the invariant."""
    t = trajectory
    n = len(t.token_ids)
    if n == 0:
        raise InvalidTrajectory("empty", "no tokens")
    for name in ("logprobs", "mask", "versions"):
        if len(getattr(t, name)) != n:
            raise InvalidTrajectory("length_mismatch", f"{len(getattr(t, name))} {name} for {n} tokens")
    bad = next((i for i, tok in enumerate(t.token_ids) if not isinstance(tok, int) or tok < 0), None)
    if bad is not None:
        raise InvalidTrajectory("bad_token_id", f"token {bad} is {t.token_ids[bad]!r}")
    if any(m not in (0, 1) for m in t.mask):
        raise InvalidTrajectory("bad_mask", "mask values must be 0 or 1")
    if not any(t.mask):
        raise InvalidTrajectory("no_trainable_tokens", "no token was sampled by the policy")
    if t.mask[0]:
        raise InvalidTrajectory("first_token_trainable", "token 0 has no context")
    for i, (m, logprob, version) in enumerate(zip(t.mask, t.logprobs, t.versions)):
        if not m:
            continue
        if not isinstance(logprob, (int, float)) or not math.isfinite(logprob) or logprob > 1e-6:
            raise InvalidTrajectory("trainable_without_logprob", f"token {i} has logprob {logprob!r}")
        if not isinstance(version, int) or version < 0:
            raise InvalidTrajectory("trainable_without_version", f"token {i} has version {version!r}")
    if t.routes is not None:
        routes = t.routes
        if not isinstance(routes, np.ndarray) or routes.dtype != np.int16 or routes.ndim != 3 \
                or routes.shape[0] != n:
            shape = getattr(routes, "shape", None)
            dtype = getattr(routes, "dtype", type(routes).__name__)
            raise InvalidTrajectory("routes_mismatch", f"routes {shape} {dtype} for {n} tokens; "
                                    "want int16 [tokens, layers, top_k]")
    if t.mm is not None:
        problem = _check_mm(t.mm, t.token_ids)
        if problem:
            raise InvalidTrajectory("mm_mismatch", problem)
    if not isinstance(t.reward, (int, float)) or not math.isfinite(t.reward):
        raise InvalidTrajectory("bad_reward", f"reward {t.reward!r}")


def validate(trajectory: Trajectory) -> str | None:
    """The reason code if `trajectory` is invalid, else None."""
    try:
        check(trajectory)
    except InvalidTrajectory as error:
        return error.reason
    return None
