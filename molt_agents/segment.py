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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from molt_agents.engines.base import Sample
from molt_env.trajectory import Trajectory


@dataclass
class Segment:
    tokenizer: object
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    routes: np.ndarray | None = None  # int16 [positions seen so far, layers, top_k], -1 where unknown

    @classmethod
    def from_text(cls, tokenizer, text: str) -> Segment:
        """A new segment whose prompt is `text` (already rendered by the chat template)."""
        segment = cls(tokenizer)
        segment.append_context(tokenizer.encode(text, add_special_tokens=False))
        return segment

    @property
    def text(self) -> str:
        """The text these exact tokens spell."""
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=False)

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

    def extend_to(self, rendered: str) -> bool:
        """Append the tokens of `rendered` beyond what this segment spells.

        Returns False, changing nothing, when `rendered` does not extend this
        segment's text (the history was rewritten).
        """
        current = self.text
        if not rendered.startswith(current):
            return False
        delta = rendered[len(current):]
        if delta:
            self.append_context(self.tokenizer.encode(delta, add_special_tokens=False))
        return True

    def truncate(self, length: int) -> None:
        """Drop everything after the first `length` tokens (undo a failed request's additions)."""
        for name in ("token_ids", "mask", "logprobs", "versions"):
            del getattr(self, name)[length:]
        if self.routes is not None:
            self.routes = self.routes[:length]

    def fork(self) -> Segment:
        """A copy whose existing tokens are context only, for a sibling choice (`n > 1`).

        The shared prefix is trained once, in the original.
        """
        twin = Segment(self.tokenizer)
        twin.append_context(list(self.token_ids))
        twin.routes = None if self.routes is None else self.routes.copy()
        return twin

    def to_trajectory(self, **facts) -> Trajectory:
        routes = None
        if self.routes is not None:  # context appended after the last sample was never routed
            routes = np.full((len(self.token_ids), *self.routes.shape[1:]), -1, dtype=np.int16)
            routes[: len(self.routes)] = self.routes[: len(self.token_ids)]
        return Trajectory(token_ids=list(self.token_ids), logprobs=list(self.logprobs), mask=list(self.mask),
                          versions=list(self.versions), finish_reason=self.finish_reason, routes=routes, **facts)
