"""A loopback session: one rollout's conversation, captured as segments.

Each request to `/s/<session>/v1/...` is matched against the session's open
segments (the choices of its last reply). If the request's rendered prompt
extends one of them, the delta is appended after its exact sampled tokens and
generation continues there; otherwise the history was rewritten and a new
segment starts from the full prompt. With `n > 1`, every choice gets its own
segment; siblings hold the shared prefix as context, so it is trained once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from molt_agents.segment import Segment
from molt_env.trajectory import Trajectory


@dataclass
class Session:
    id: str
    tokenizer: object
    rollout_id: str = ""
    group_id: str = ""
    defaults: dict = field(default_factory=dict)  # sampling defaults for requests that set none
    requests: int = 0  # generation requests so far: the default seed's turn (`engines.base.turn_seed`)
    segments: list[Segment] = field(default_factory=list)
    open: list[Segment] = field(default_factory=list)  # the last reply's choices, extendable
    finished: bool = False  # set when `Loopback.finish` claims it: a request then captures nothing more
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    vision: object | None = None  # the policy's image processor, for a vision-language model
    conversations: dict[str, list[dict]] = field(default_factory=dict)  # stored Responses replies, by id
    chat: list[dict] | None = None  # the last chat request's messages and its first reply (what a reward model reads)

    def base_for_text(self, rendered: str, images: list = ()) -> Segment:
        """The segment to continue for a prompt that renders to `rendered` (with the conversation's `images`)."""
        for segment in self.open:
            if segment.extend_to(rendered, images):
                return segment
        segment = Segment.from_text(self.tokenizer, rendered, self.vision, images)
        self.segments.append(segment)
        return segment

    def base_for_ids(self, prompt_ids: list[int]) -> Segment:
        """The segment to continue for a raw token-id prompt (`/completions`)."""
        for segment in self.open:
            n = len(segment.token_ids)
            if prompt_ids[:n] == segment.token_ids:
                segment.append_context(prompt_ids[n:])
                return segment
        segment = Segment(self.tokenizer)
        segment.append_context(list(prompt_ids))
        self.segments.append(segment)
        return segment

    def choices(self, base: Segment, n: int) -> list[Segment]:
        """`n` segments to receive the `n` samples: the base and forks of it."""
        forks = [base.fork() for _ in range(n - 1)]
        self.segments += forks
        self.open = [base, *forks]
        return self.open

    def mark(self) -> tuple:
        """A point to `restore` to if a request fails, before or after its samples are appended."""
        return len(self.segments), list(self.open), [(len(s.token_ids), s.finish_reason) for s in self.open]

    def restore(self, mark: tuple) -> None:
        count, open_segments, ends = mark
        del self.segments[count:]
        self.open = open_segments
        for segment, (length, finish_reason) in zip(open_segments, ends):
            segment.truncate(length)
            segment.finish_reason = finish_reason

    def trajectories(self, reward: float, info: dict | None = None, messages: bool = False) -> list[Trajectory]:
        """The session's segments with its reward (segments with nothing sampled left out); with `messages`,
        each carries the session's last chat (`chat`)."""
        kept = [s for s in self.segments if any(s.mask)]
        return [s.to_trajectory(reward=reward, rollout_id=self.rollout_id or self.id, group_id=self.group_id,
                                segment=i, num_segments=len(kept), info={**(info or {}), "session": self.id},
                                messages=self.chat if messages else None)
                for i, s in enumerate(kept)]
