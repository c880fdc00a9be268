"""The benchmark's workloads: a model, a warm start, the task "a+b=", and the run's settings.

Shared by both sides of the benchmark, so this file imports only numpy,
torch and transformers (TRL's virtual environment has no Molt):

- `operands(rng)` draws a problem; Molt's environment (`bench/addition.py`)
  draws it from the episode's seeded generator, and TRL's dataset from
  `numpy.random.default_rng(env_seed(seed, index))`, the same generator
  Gymnasium seeds, so both see the same prompts in the same order.
- `reward(text, answer)` scores a reply the same way on both sides.
- `build(name, out)` (Molt's venv: it uses Molt's offline model builder) writes
  the workload's model after a short supervised warm start that teaches only
  the answer format: a random number from 0 to 18, then the end of the turn.
"""

from __future__ import annotations

import random
from pathlib import Path

# Qwen3 sizes; `max_tokens` is the most new tokens a reply may take.
WORKLOADS = {
    "small": dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                  vocab_size=1024, max_tokens=3),
    "large": dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                  vocab_size=1024, max_tokens=16),
}

# The run, identical for both systems.
GROUPS_PER_STEP = 16
GROUP_SIZE = 8
TEMPERATURE = 1.0
LR = 1e-4
LORA_RANK, LORA_LR = 16, 1e-3  # Molt's LoRA runs (bench/run.py --systems molt-lora); not TRL's
CLIP = 0.2
WARM_START_STEPS = 20
MAX_OPERAND = 9


def env_seed(seed: int, index: int) -> int:
    """The environment seed of prompt group `index` (Molt's `GroupStream.env_seed`)."""
    return seed * 1_000_003 + index


def operands(rng) -> tuple[int, int]:
    """a and b, uniform in 0..MAX_OPERAND, from a numpy Generator."""
    a, b = (int(x) for x in rng.integers(0, MAX_OPERAND + 1, size=2))
    return a, b


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def reward(text: str, answer: int) -> float:
    """1 when the reply (special tokens removed) is exactly the sum, else 0."""
    return float(text.strip() == str(answer))


def build(name: str, out: str | Path, seed: int = 0) -> Path:
    """The workload's model in `out`: Molt's tiny Qwen3 at these sizes, warm-started on the answer format."""
    import torch

    from molt_agents.tiny.build import build_tiny

    sizes = {k: v for k, v in WORKLOADS[name].items() if k != "max_tokens"}
    out = Path(out)
    build_tiny("dense", out, seed=seed, **sizes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.manual_seed(seed)
    _warm_start(model, tokenizer, random.Random(seed))
    model.save_pretrained(out)
    return out


def _warm_start(model, tokenizer, rng: random.Random, batch: int = 32, lr: float = 3e-3) -> None:
    """WARM_START_STEPS of supervised replies: a prompt "a+b=" and a random number from 0 to 18 that is not
    its sum's function (drawn independently), then the end of the turn; the loss is on the reply only."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    pad = tokenizer.pad_token_id
    for _ in range(WARM_START_STEPS):
        rows = []
        for _ in range(batch):
            a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
            messages = [{"role": "user", "content": prompt(a, b)}]
            head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "content": str(rng.randint(0, 2 * MAX_OPERAND))}],
                tokenize=False)
            reply = full[len(head):].rstrip("\n")
            head_ids = tokenizer.encode(head, add_special_tokens=False)
            reply_ids = tokenizer.encode(reply, add_special_tokens=False)
            rows.append((head_ids + reply_ids, [-100] * len(head_ids) + reply_ids))
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
        model(input_ids=input_ids, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
