"""A growing token sequence that keeps sampled tokens exactly as sampled.

Multi-turn stitching, used by the env runner and the loopback alike: the
conversation so far is a list of token ids, of which the sampled ones are
kept verbatim. When the conversation grows, the new text is rendered with the
chat template and checked against the text those exact tokens spell; if the
new rendering extends it, only the difference (the end of the assistant turn,
a user or tool turn, the next generation prompt) is tokenized and appended.
If not, the history was rewritten and the caller starts a new segment.

Earlier generated text is never re-tokenized: decode-then-encode is not the
identity for byte-level BPE, and the tokens trained must be the tokens sampled.

Images: with a `Vision` processor, the prompt and every delta go through the
model's processor, which expands each image placeholder into the model's
image tokens; the segment keeps each picture, its tensors and its span of
expanded tokens. Its `text` shows each span as the single placeholder the
chat template writes, so a re-rendered conversation still lines up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from molt_agents.engines.base import Sample
from molt_agents.engines.stepped import fit_routes
from molt_agents.multimodal import PromptImages, collapse, join_images
from molt_env.trajectory import Trajectory


@functools.lru_cache(maxsize=1024)
def _encode(tokenizer, text: str) -> tuple[int, ...]:
    """Rendered template text as tokens (the template wrote every special token it wants). Cached: the
    episodes of a group share their prompt, and turns repeat their deltas."""
    return tuple(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class Segment:
    tokenizer: object
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    routes: np.ndarray | None = None  # int16 [positions seen so far, layers, top_k], -1 where unknown
    vision: object | None = None  # a `multimodal.Vision` when the policy sees images
    spans: list[list[int]] = field(default_factory=list)  # [start, length] of each image's expanded tokens
    images: list[dict] = field(default_factory=list)  # each image's processor tensors, in order
    pictures: list = field(default_factory=list)  # each image as a PIL image, in order

    @classmethod
    def from_text(cls, tokenizer, text: str, vision=None, images: list = ()) -> Segment:
        """A new segment whose prompt is `text` (already rendered by the chat template) with its images."""
        segment = cls(tokenizer, vision=vision)
        segment._append_rendered(text, list(images))
        return segment

    @property
    def text(self) -> str:
        """The text these exact tokens spell (each image's span as one placeholder, as the template writes it)."""
        ids = collapse(self.token_ids, self.spans, self.vision.placeholder_id) if self.spans else self.token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_images(self) -> PromptImages | None:
        """This sequence's images, for an engine (None without images)."""
        if not self.images:
            return None
        return PromptImages(list(self.pictures), [list(s) for s in self.spans], self.vision.placeholder_id,
                            list(self.images))

    def _append_rendered(self, text: str, new_images: list) -> None:
        if self.vision is None:
            if new_images:
                raise ValueError("this policy takes no images: it is not a vision-language model")
            self.append_context(list(_encode(self.tokenizer, text)))
            return
        ids, spans, tensors = self.vision.encode(text, new_images)
        self.spans += [[len(self.token_ids) + start, length] for start, length in spans]
        self.images += tensors
        self.pictures += new_images
        self.append_context(ids)

    def append_context(self, token_ids: list[int]) -> None:
        """Tokens the policy did not sample (prompt, env or tool turns): never trained."""
        self.token_ids += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [None] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    def append_sample(self, sample: Sample) -> None:
        """Tokens the engine sampled, with their logprobs and versions: trained."""
        self.token_ids += sample.token_ids
        self.mask += [1] * len(sample.token_ids)
        self.logprobs += list(sample.logprobs)
        self.versions += list(sample.versions)
        self.finish_reason = sample.finish_reason
        if sample.routes is not None:
            self._merge_routes(np.asarray(sample.routes, dtype=np.int16))

    def _merge_routes(self, rows: np.ndarray) -> None:
        """Keep the experts recorded when each position was first computed; fill positions still unknown."""
        if self.routes is None:
            self.routes = rows.copy()
            return
        known = len(self.routes)
        unknown = (self.routes[: len(rows)] < 0).all(axis=(1, 2))
        self.routes[: len(rows)][unknown] = rows[: known][unknown[: len(rows)]]
        self.routes = np.concatenate([self.routes, rows[known:]])

    def extend_to(self, rendered: str, images: list = ()) -> bool:
        """Append the tokens of `rendered` beyond what this segment spells; `images` are all the
        conversation's images, of which those past this segment's own are new.

        Returns False, changing nothing, when `rendered` does not extend this
        segment's text (the history was rewritten).
        """
        current = self.text
        if not rendered.startswith(current) or len(images) < len(self.images):
            return False
        delta = rendered[len(current):]
        if delta:
            self._append_rendered(delta, list(images[len(self.images):]))
        return True

    def truncate(self, length: int) -> None:
        """Drop everything after the first `length` tokens (undo a failed request's additions)."""
        for name in ("token_ids", "mask", "logprobs", "versions"):
            del getattr(self, name)[length:]
        if self.routes is not None:
            self.routes = self.routes[:length]
        kept = sum(start < length for start, _ in self.spans)
        del self.spans[kept:], self.images[kept:], self.pictures[kept:]

    def fork(self) -> Segment:
        """A copy whose existing tokens are context only, for a sibling choice (`n > 1`).

        The shared prefix is trained once, in the original.
        """
        twin = Segment(self.tokenizer, vision=self.vision, spans=[list(s) for s in self.spans],
                       images=list(self.images), pictures=list(self.pictures))
        twin.append_context(list(self.token_ids))
        twin.routes = None if self.routes is None else self.routes.copy()
        return twin

    def to_trajectory(self, **facts) -> Trajectory:
        routes = fit_routes(self.routes, len(self.token_ids))  # context after the last sample was never routed
        mm = None
        if self.images:
            mm = {"placeholder_id": self.vision.placeholder_id, "spans": [list(s) for s in self.spans],
                  "tensors": join_images(self.images)}
        return Trajectory(token_ids=list(self.token_ids), logprobs=list(self.logprobs), mask=list(self.mask),
                          versions=list(self.versions), finish_reason=self.finish_reason,
                          routes=None if routes is None else routes.copy(), mm=mm,
                          **facts)

