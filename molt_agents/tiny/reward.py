"""The tiny reward model's offline training: a preference a policy can learn by RL from its score alone.

`tiny:reward` is a sequence classifier (Qwen3 with a one-output score head,
as the public reward models are) over the tiny tokenizer and its chat
template. It is trained here, before any run, on conversations of the
default task's shape: a user asks "Repeat the digit 7." and the assistant
replies. A reply that starts with the asked digit is preferred (label 1);
any other reply is not (label 0): another digit, a digit after words, or
words alone. The loss is binary cross-entropy on the score read at the
conversation's last token, so the score is a logit: above 0 for a preferred
reply, below 0 for the others. Trained for 1500 steps it separates every asked
digit from every other bare digit by a wide margin (scores of at least 8.4
against at most -8.8); after 400, two of the 90 wrong pairs scored above 0,
and a policy rewarded by it learned to answer 7 to every prompt, which those
errors paid for.

A run rewarded by this model alone (`--reward.model tiny:reward
--reward.keep_env false` on `digit`) learns the task without the task's rule;
the rule, still computed, measures how far (`env/env_reward`).
"""

from __future__ import annotations

import random

import torch

from molt_agents.tiny.tokenizer import _WORDS


def conversation(asked: int, reply: str) -> list[dict]:
    return [{"role": "user", "content": f"Repeat the digit {asked}."}, {"role": "assistant", "content": reply}]


def preferred(asked: int, reply: str) -> bool:
    """The preference the model is trained on: the reply starts with the asked digit."""
    return reply.strip()[:1] == str(asked)


def _example(rng: random.Random) -> tuple[list[dict], float]:
    asked = rng.randrange(10)
    kind = rng.random()
    if kind < 0.5:  # a bare digit: the asked one half the time
        reply = str(asked if rng.random() < 0.5 else rng.randrange(10))
    elif kind < 0.7:  # a digit, then words
        reply = f"{asked if rng.random() < 0.5 else rng.randrange(10)} {' '.join(rng.sample(_WORDS, 2))}"
    elif kind < 0.85:  # words, then the asked digit: not preferred
        reply = f"{' '.join(rng.sample(_WORDS, rng.randint(1, 3)))} {asked}"
    else:  # words alone
        reply = " ".join(rng.sample(_WORDS, rng.randint(1, 4)))
    return conversation(asked, reply), float(preferred(asked, reply))


def train_reward(model, tokenizer, steps: int = 1500, batch: int = 64, lr: float = 3e-3, seed: int = 0) -> None:
    """Train `model` (a sequence classifier with one output) in place on `_example` conversations."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        examples = [_example(rng) for _ in range(batch)]
        texts = [tokenizer.apply_chat_template(messages, tokenize=False) for messages, _ in examples]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        scores = model(**inputs).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, torch.tensor([y for _, y in examples]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
