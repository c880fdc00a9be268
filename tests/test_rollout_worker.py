"""The rollout worker in this process, without Ray, on the hf engine."""

from __future__ import annotations

import asyncio
import gc

from molt_agents.engines import SamplingParams
from molt_train.config import EngineConfig, RolloutConfig
from molt_train.rollout import RolloutWorker


def test_the_worker_freezes_its_heap_once_its_first_groups_are_played(dense_dir):
    worker = RolloutWorker(str(dense_dir), "digit", RolloutConfig(max_tokens=2),
                           EngineConfig(name="hf", max_model_len=256), SamplingParams(max_tokens=2, seed=0))
    frozen = gc.get_freeze_count()
    try:
        first = asyncio.run(worker.groups([(0, 0), (1, 1)], 2))
        assert [len(group.trajectories) for group in first] == [2, 2]
        after_first = gc.get_freeze_count()
        assert after_first > frozen  # the engine, the tokenizer and the episodes' modules: out of the scans
        second = asyncio.run(worker.groups([(2, 2)], 2))
        # Once, not every call: the second call's objects (its groups, alive here) stay out of the frozen set,
        # which only loses the frozen objects freed since.
        assert len(second[0].trajectories) == 2 and gc.get_freeze_count() <= after_first
    finally:
        gc.unfreeze()  # this test's process goes on with other tests
        worker.close()
