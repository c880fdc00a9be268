"""Evaluation: held-out episodes, greedy or sampled, scored apart from training.

Training reward is sampled at the training temperature on the very prompts
being trained on. Evaluation plays the episodes of `molt_env.split`'s
evaluation range (seeds training never draws), `eval.samples` times each at
`eval.temperature` (0 = greedy), and reports

    reward       the mean reward over every play
    pass@1       the mean over episodes of c / n        (c of the n plays passed)
    pass@k       the mean of 1 - C(n-c, k) / C(n, k)    (k = n = eval.samples; algorithms.pass_at_k)

An episode passes when its reward is at least `eval.pass_threshold`; one
that failed (the environment raised, it timed out) scores 0 and is counted.

During training (`Evaluator`) the rollout workers play them between steps,
with the weights of the version just synced (every sampled token carries
it: `eval/version`); the records come back here, never into the trainer's
queue. Asynchronous runs keep generating their look-ahead groups on the same
engines meanwhile. `molt-eval` (`eval_cli`) plays the same episodes on a
checkpoint or an OpenAI-compatible endpoint and reports the same summary.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import ray

from molt_agents.engines.base import SamplingParams
from molt_agents.episode import Episode
from molt_train.algorithms.pass_at_k import pass_at_k

# ---------------------------------------------------------------------------
# One play of an evaluation episode, and the summary of many


def eval_sampling(config) -> SamplingParams:
    """How a run (a `Config`) samples its evaluation episodes: `eval.temperature` over the whole distribution,
    the run's reply length and seed."""
    return SamplingParams(temperature=config.eval.temperature, top_p=1.0, max_tokens=config.rollout.max_tokens,
                          seed=config.seed)


def episode_record(episode: int, seed: int, sample: int, played: Episode) -> dict:
    """The score of one play: reward, turns and tokens (None where the player cannot tell), the weight versions
    that sampled it (none known for an endpoint), the first line of its failure, and its text."""
    return {"episode": episode, "seed": seed, "sample": sample, "reward": played.reward, "turns": played.turns,
            "completion_tokens": played.completion_tokens, "total_tokens": played.total_tokens,
            "versions": played.versions, "failure": played.failure.splitlines()[0] if played.failure else None,
            "text": played.text}


def summarize(records: list[dict], pass_threshold: float) -> dict:
    """reward, pass@1, pass@k (k = plays per episode), failed, mean turns and tokens, and the weights' version
    (None when more than one sampled the plays)."""
    plays = defaultdict(list)
    for record in records:
        plays[record["episode"]].append(record["failure"] is None and record["reward"] >= pass_threshold)
    k = min(len(passed) for passed in plays.values())
    count = len(records)
    versions = {version for record in records for version in record["versions"]}
    summary = {
        "reward": sum(record["reward"] for record in records) / count,
        "pass@1": sum(pass_at_k(len(p), sum(p), 1) for p in plays.values()) / len(plays),
        f"pass@{k}": sum(pass_at_k(len(p), sum(p), k) for p in plays.values()) / len(plays),
        "failed": sum(record["failure"] is not None for record in records),
        "turns": _mean(record["turns"] for record in records),
        "completion_tokens": _mean(record["completion_tokens"] for record in records),
        "episodes": len(plays),
    }
    if versions:
        summary["version"] = versions.pop() if len(versions) == 1 else None
    return summary


def _mean(values) -> float | None:
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known else None


# ---------------------------------------------------------------------------
# During training


class Evaluator:
    """When a run evaluates (`eval.*`), and its evaluations on the rollout workers as `eval/*` metrics."""

    def __init__(self, config, workers, recover):
        """`recover()` brings workers Ray restarted up to the run (the runtime's `check_workers`)."""
        self.eval, self.steps, self.workers, self.recover = config.eval, config.steps, workers, recover
        self.sampling = eval_sampling(config)
        self.last_reward: float | None = None
        self.plays: list[dict] = []  # the last evaluation's records, one per play

    def due(self, step: int) -> bool:
        """After every `eval.every` steps and after the last; step 0 (before training) with `eval.at_start`."""
        if step == 0:
            return self.eval.at_start
        return bool(self.eval.every) and (step % self.eval.every == 0 or step == self.steps)

    async def run(self) -> dict:
        """Evaluate the weights the engines hold now: `eval/*` and `time/eval` (seconds)."""
        started = time.perf_counter()
        for attempt in range(3):
            try:
                records = await self._play()
                break
            except ray.exceptions.RayActorError:  # a worker died mid-evaluation: evaluate again once it is back
                if attempt == 2:
                    raise
                await self.recover()
        summary = summarize(records, self.eval.pass_threshold)
        self.last_reward, self.plays = summary["reward"], records
        return {f"eval/{key}": value for key, value in summary.items()} | {"time/eval": time.perf_counter() - started}

    async def _play(self) -> list[dict]:
        workers = self.workers
        shares = [list(range(self.eval.episodes))[i::len(workers)] for i in range(len(workers))]
        played = await asyncio.gather(*(worker.evaluate.remote(share, self.eval.samples, self.sampling)
                                        for worker, share in zip(workers, shares) if share))
        return [record for records in played for record in records]
