"""`reasoning_gym:<task>`: any of reasoning-gym's ~100 procedurally generated tasks as a Molt environment.

    pip install 'molt[reasoning-gym]'
    molt-train --env reasoning_gym:leg_counting

Single turn. The prompt is reasoning-gym's question with its own answer
instruction (`<answer>...</answer>`); the reward is the task's own
`score_answer` (in [0, 1], partial credit where the task gives it) of what
is inside the tags. Keyword arguments after the task name go to the task's
dataset config (e.g. `min_animals=3`); `size` entries are generated once
from `dataset_seed`, and each episode seed picks one of them: training
episodes from the first `size - eval_size`, evaluation episodes
(`molt_env.split`) from the last `eval_size` (default: a tenth), which
training never sees.
"""

from __future__ import annotations

from molt_env import Env
from molt_env.split import EVAL, split_of


class ReasoningGym(Env):
    def __init__(self, task: str, size: int = 10_000, dataset_seed: int = 0, eval_size: int | None = None,
                 **config):
        try:
            import reasoning_gym
            from reasoning_gym.utils import SYSTEM_PROMPTS
        except ImportError:
            raise ImportError("the reasoning_gym environments need reasoning-gym: "
                              "pip install 'molt[reasoning-gym]'") from None
        if task not in reasoning_gym.factory.DATASETS:
            known = ", ".join(sorted(reasoning_gym.factory.DATASETS)[:12])
            raise ValueError(f"reasoning-gym has no task {task!r} (some it has: {known}, ...)")
        eval_size = max(size // 10, 1) if eval_size is None else eval_size
        if not 1 <= eval_size < size:
            raise ValueError(f"eval_size={eval_size}: hold out at least one and fewer than size={size} entries")
        self.task, self.eval_size = task, eval_size
        self.dataset = reasoning_gym.create_dataset(task, seed=dataset_seed, size=size, **config)
        self.instruction = SYSTEM_PROMPTS["default"]

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        train_size = len(self.dataset) - self.eval_size
        if split_of(seed, options) == EVAL:
            self.index = train_size + int(self.np_random.integers(self.eval_size))
        else:
            self.index = int(self.np_random.integers(train_size))
        self.entry = self.dataset[self.index]
        messages = [{"role": "system", "content": self.instruction},
                    {"role": "user", "content": self.entry["question"]}]
        return messages, {"task": self.task, "answer": str(self.entry["answer"])}

    def step(self, action: str):
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(action)
        reward = float(self.dataset.score_answer(answer, self.entry))
        return "", reward, True, False, {"extracted": answer}
