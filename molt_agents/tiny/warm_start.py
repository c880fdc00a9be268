"""A short supervised warm start for the tiny chat model: the reply format only.

A randomly initialised model almost never ends its turn or answers briefly,
so RL from it has nothing to reinforce. This teaches one habit, on prompts
from the tokenizer corpus: the assistant answers with a single random digit
and ends the turn. The digit is independent of the prompt, so no task is
learned here; a task's mapping is left to RL.
"""

from __future__ import annotations

import random

import torch

from molt_agents.chat_template import render_text
from molt_agents.tiny.tokenizer import _corpus_lines


def warm_start(model, tokenizer, steps: int = 150, batch: int = 32, lr: float = 3e-3, seed: int = 0) -> None:
    """Train `model` in place on chat turns `user: <corpus line> / assistant: <digit>`."""
    rng = random.Random(seed)
    # Prompts without digits: the model learns the reply format, not to ignore digits it reads.
    prompts = [line for line in _corpus_lines(seed + 1, 4000)
               if "\n" not in line and not any(c.isdigit() for c in line)][:1000]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            messages = [{"role": "user", "content": rng.choice(prompts)}]
            prompt = render_text(tokenizer, messages)
            full = render_text(tokenizer, messages + [{"role": "assistant", "content": str(rng.randrange(10))}],
                               add_generation_prompt=False)
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
            reply_ids = tokenizer.encode(full[len(prompt):].rstrip("\n"), add_special_tokens=False)
            rows.append((prompt_ids + reply_ids, [-100] * len(prompt_ids) + reply_ids))
        width = max(len(ids) for ids, _ in rows)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()

