"""The rollout engine interface: token ids in, sampled token ids and logprobs out.

Every backend (vLLM, the transformers fallback) implements this one small
async interface. Engines know nothing about chat templates or text: the
caller tokenizes, the engine samples, and what it returns is exactly what it
sampled, with the logprob of each sampled token under the sampling
distribution and the weight version that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from molt_agents.multimodal import PromptImages


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. `n` completions share the prompt."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    top_logprobs: int = 0  # also return this many most likely tokens per position

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of an episode's `turn`-th request (from 0) when the episode is seeded with `seed`.

    Each turn gets a stream of its own: with one seed for every turn, the same random draws would pick
    every reply, so a policy whose next-token distribution barely changes between turns (an untrained
    one, say) would repeat its first reply on every turn instead of exploring."""
    return seed if seed is None or turn == 0 else (seed + turn * 1_000_003) % 2**62


@dataclass
class Sample:
    """One sampled completion, aligned token by token."""

    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the sampling distribution
    versions: list[int]  # engine weight version that sampled each token
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    routes: object | None = None  # optional int16 [prompt+completion, layers, top_k] expert ids
    prompt_len: int = 0
    top_logprobs: list[dict[int, float]] | None = None  # when asked: most likely tokens per position


@runtime_checkable
class Engine(Protocol):
    """What the env runner, the loopback and the trainer need from an engine."""

    version: int  # weight version; bumped by every update_weights

    async def generate(self, prompt_ids: list[int], params: SamplingParams, on_tokens=None,
                       images: PromptImages | None = None) -> list[Sample]:
        """Sample `params.n` completions of `prompt_ids`.

        `images`, for a vision-language model: the prompt's pictures, their processor tensors
        (`pixel_values`, ...) and each one's span of image tokens in `prompt_ids`, in order.

        `on_tokens(choice_index, progress)`, if given, is called on the caller's
        event loop with each step's new tokens (`progress.token_ids`, `.logprobs`).
        """

    async def pause(self) -> None:
        """Stop scheduling new tokens; requests in flight wait, keeping their state."""

    async def resume(self) -> None:
        """Continue the requests in flight (under whatever weights are loaded now)."""

    async def update_weights(self, named_tensors) -> int:
        """Load new weights in place, bump and return the version."""

    def close(self) -> None:
        """Release the engine."""
