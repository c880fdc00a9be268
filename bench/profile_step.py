"""Profile one trainer step of the benchmark workload, in this process (no Ray, no engine).

    .venv/bin/python bench/profile_step.py [--workload small] [--steps 20] [--micro-batch-tokens 1024]
                                           [--no-share-prefix] [--cprofile] [--torch-profile]

Builds Molt's `PolicyRank` (one rank) on the workload's model, and a batch
shaped like the workload's (16 prompts x 8 replies of the reply length the
warm-started model writes), packed as the trainer group packs it; then times
the phases of `PolicyRank.step` over `--steps` steps (the median), with
cProfile or torch.profiler for the breakdown inside them. Next to it, the
floor: plain transformers on the same sequences as one padded batch (the old
logprobs without gradients, then forward, backward and AdamW).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402


def items_for(tokenizer, rng: random.Random, reply_tokens: int):
    """16 x 8 training items: a prompt "a+b=" and a reply of `reply_tokens` tokens (a number, the end of turn)."""
    from molt_train.packing import TrainItem

    items = []
    for _ in range(workload.GROUPS_PER_STEP):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        head = tokenizer.apply_chat_template([{"role": "user", "content": workload.prompt(a, b)}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
        for _ in range(workload.GROUP_SIZE):
            reply = tokenizer.encode(str(rng.randint(0, 18)), add_special_tokens=False)[:reply_tokens - 1]
            reply += [tokenizer.eos_token_id] * (reply_tokens - len(reply))
            ids = list(head) + reply
            mask = [0] * len(head) + [1] * len(reply)
            items.append(TrainItem(token_ids=ids, mask=mask, logprobs=[-2.0 if m else None for m in mask],
                                   ages=[0] * len(ids), advantage=rng.gauss(0, 1)))
    return items


def molt_step(model_dir: str, items, steps: int, micro_batch_tokens: int, profiler: str | None,
              share_prefix: bool = True) -> dict:
    from molt_train.actor.policy import PolicyRank
    from molt_train.config import Config
    from molt_train.model_fit import model_config
    from molt_train.packing import deal, pack
    from molt_train.trainer import attention_per_token
    from molt_train.weight_sync import free_endpoint

    config = Config()
    config.train.lr, config.train.lr_schedule, config.algo.kl_coef = workload.LR, "constant", 0.0
    config.train.micro_batch_tokens, config.steps = micro_batch_tokens, steps
    host, port = free_endpoint()
    rank = PolicyRank(model_dir, model_dir, 0, 1, f"tcp://{host}:{port}", config)
    times: dict[str, list[float]] = {}

    def timed(name, fn, *args):
        started = time.perf_counter()
        out = fn(*args)
        times.setdefault(name, []).append(time.perf_counter() - started)
        return out

    step_tokens = sum(sum(item.mask) for item in items)
    for step in range(steps + 2):
        if step == 2:
            times.clear()  # the first steps warm up allocators and caches
        max_width = min(micro_batch_tokens, config.rollout.max_total_tokens)  # as the trainer group packs
        tree_tokens = max_width if share_prefix else 0
        micro_batches = timed("pack", lambda: deal(pack(items, micro_batch_tokens, True, tree_tokens, max_width,
                                                        attention_per_token(model_config(model_dir))), 1)[0])
        if profiler and step == steps + 1:
            return {"profile": _profiled(profiler, lambda: rank.step(micro_batches, step_tokens))} | _medians(times)
        timed("step", rank.step, micro_batches, step_tokens)
    return _medians(times)


def floor_step(model_dir: str, items, steps: int) -> dict:
    """Plain transformers on one padded batch: old logprobs (no grad), forward + backward, AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.LR)
    width = max(len(item.token_ids) for item in items)
    ids = torch.tensor([item.token_ids + [0] * (width - len(item.token_ids)) for item in items])
    attention = torch.tensor([[1] * len(item.token_ids) + [0] * (width - len(item.token_ids)) for item in items])
    mask = torch.tensor([item.mask + [0] * (width - len(item.mask)) for item in items], dtype=torch.float32)[:, 1:]
    advantages = torch.tensor([item.advantage for item in items])[:, None]

    def logprobs():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]

    times: list[float] = []
    for step in range(steps + 2):
        started = time.perf_counter()
        with torch.no_grad():
            old = logprobs()
        ratio = torch.exp(logprobs() - old)
        loss = -(torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages) * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= 2:
            times.append(time.perf_counter() - started)
    return {"floor": statistics.median(times)}


def _profiled(kind: str, fn) -> str:
    if kind == "cprofile":
        import cProfile
        import io
        import pstats

        profile = cProfile.Profile()
        profile.runcall(fn)
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(40)
        return out.getvalue()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)


def _medians(times: dict[str, list[float]]) -> dict:
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(workload.WORKLOADS), default="small")
    parser.add_argument("--model", help="the workload's model (default: build it in a temporary directory)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reply-tokens", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--no-share-prefix", action="store_true", help="train each reply whole (no prefix trees)")
    parser.add_argument("--cprofile", action="store_const", const="cprofile", dest="profiler")
    parser.add_argument("--torch-profile", action="store_const", const="torch", dest="profiler")
    args = parser.parse_args()
    model_dir = args.model or str(workload.build(args.workload, tempfile.mkdtemp(prefix="molt-bench-")))
    from transformers import AutoTokenizer

    items = items_for(AutoTokenizer.from_pretrained(model_dir), random.Random(0), args.reply_tokens)
    tokens = sum(len(item.token_ids) for item in items)
    print(f"batch: {len(items)} sequences, {tokens} tokens; torch threads {torch.get_num_threads()}")
    molt = molt_step(model_dir, items, args.steps, args.micro_batch_tokens, args.profiler, not args.no_share_prefix)
    if "profile" in molt:
        print(molt.pop("profile"))
    floor = floor_step(model_dir, items, args.steps)
    for name, seconds in (molt | floor).items():
        print(f"{name:>8}: {seconds * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
