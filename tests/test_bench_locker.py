"""The agentic benchmark's Molt-free copy of the locker task (bench/locker_task.py) against the task itself
(environments/locker.py), and its latency environment (bench/locker_env.py). No engine."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import locker_task  # noqa: E402

from environments.locker import LOOKUP, Locker  # noqa: E402


def test_the_schema_is_the_tasks():
    assert locker_task.LOOKUP == LOOKUP


def random_arguments(rng: random.Random) -> str:
    """Arguments a tiny model might write: mostly right, some out of range, of a wrong type, or broken."""
    return rng.choice([json.dumps({"id": rng.randint(1, 9)}), json.dumps({"id": rng.randint(-1, 12)}),
                       json.dumps({"id": str(rng.randint(1, 9))}), json.dumps({"id": True}), '{"id": 3',
                       json.dumps([3]), json.dumps({})])


@pytest.mark.parametrize("run_seed", [0, 1, 7])
def test_episodes_calls_and_rewards_agree_with_locker(run_seed):
    rng = random.Random(run_seed)
    for group in range(100):
        env = Locker()
        prompt, info = env.reset(seed=run_seed * 1_000_003 + group)  # GroupStream.env_seed
        digits, locker = locker_task.episode(run_seed, group)
        assert (digits, locker, locker_task.prompt(locker)) == (env.digits, env.locker, prompt)
        episode = locker_task.LockerEpisode(digits, locker)
        assert episode.answer == info["answer"]
        for _ in range(rng.randint(0, 3)):
            name = rng.choice(["lookup", "lookup", "lookup", "open"])
            arguments = random_arguments(rng)
            assert episode.call(name, arguments) == env.call(name, arguments)
        answer = rng.choice([str(episode.answer), str(rng.randint(0, 9)), f" {episode.answer} is it", ""])
        _, reward, terminated, _, _ = env.step(answer)
        assert terminated and episode.reward(answer) == reward


def test_latency_waits_only_for_calls_whose_results_are_read():
    import locker_env

    call = '<tool_call>\n{"name": "lookup", "arguments": {"id": 1}}\n</tool_call>'

    async def play(replies):
        env = locker_env.Locker100ms()
        env.reset(seed=0)
        started = time.perf_counter()
        for reply in replies:
            await env.astep(reply)
        return time.perf_counter() - started

    assert asyncio.run(play(["5"])) < 0.05  # an answer: no call
    assert 0.2 <= asyncio.run(play([call, call])) < 0.3  # two replies whose results the next reply reads
    assert 0.2 <= asyncio.run(play([call, call, call])) < 0.3  # the third truncates: its result is never read
