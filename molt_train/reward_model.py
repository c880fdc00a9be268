"""`RewardModel`: a reward model as a Ray actor of its own, scoring finished episodes.

`--reward.model DIR` names a Hugging Face sequence classifier with one output
(a score head on a causal LM, as public reward models are: Skywork-Reward,
InternLM2-Reward, the `*ForSequenceClassification` of Llama, Qwen, Mistral,
Gemma). The run places it like its other processes (a GPU of its own on a GPU
cluster, else a CPU) and the rollout workers send it each finished group's
conversations. A conversation is rendered with the reward model's own chat
template and scored at its last token; conversations go through the model
in batches of `--reward.batch_size`, padded on the right, each score read
at its own last token (so it equals the score of the conversation alone).

The rule that combines the scores with the environment's reward (`combine`):
an episode's reward is `weight * score`, plus the environment's reward when
`--reward.keep_env` (the default). Its trajectories keep both in their info
(`env_reward`, `rm_score`), which the run reports as `env/env_reward` and
`env/rm_score`.
"""

from __future__ import annotations

import torch

from molt_env.trajectory import Trajectory


class RewardModel:
    def __init__(self, model_dir: str, batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype="auto").to(self.device).eval()
        if self.model.config.num_labels != 1 or not hasattr(self.model, "score"):
            raise ValueError(f"--reward.model {model_dir}: not a reward model (a sequence classifier with one "
                             f"output and a `score` head); it has {self.model.config.num_labels} output(s)")
        if self.tokenizer.pad_token_id is None:  # padding is never read: any id will do
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.batch_size = batch_size

    def score(self, conversations: list[list[dict]]) -> list[float]:
        """One score per conversation (chat messages, the last reply included)."""
        texts = [self.tokenizer.apply_chat_template(messages, tokenize=False) for messages in conversations]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            scores += self._forward(texts[start:start + self.batch_size])
        return scores

    @torch.no_grad()
    def _forward(self, texts: list[str]) -> list[float]:
        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False).to(self.device)
        hidden = self.model.base_model(**inputs).last_hidden_state
        last = inputs["attention_mask"].sum(1) - 1
        return self.model.score(hidden[torch.arange(len(texts), device=self.device), last])[:, 0].float().tolist()


def combine(trajectories: list[Trajectory], score: float, weight: float, keep_env: bool) -> None:
    """Set the reward of an episode's `trajectories` (in place) from the reward model's `score` and the
    environment's reward they carry (see the module docstring)."""
    env_reward = trajectories[0].reward
    reward = weight * score + (env_reward if keep_env else 0.0)
    for trajectory in trajectories:
        trajectory.reward = reward
        trajectory.info = {**trajectory.info, "env_reward": env_reward, "rm_score": score}
