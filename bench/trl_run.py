"""TRL's side of the benchmark: GRPO on "a+b=" with TRL's GRPOTrainer, one JSON line per optimizer step.

Runs in bench/.venv-trl (bench/setup_trl.sh: TRL, no Molt):

    bench/.venv-trl/bin/python bench/trl_run.py --model DIR --workload small --seed 0 --steps 300 --out trl.jsonl

The run is Molt's (bench/run.py), in TRL's names:

- One optimizer step is GROUPS_PER_STEP prompts x GROUP_SIZE samples. TRL counts its batches in completions:
  per_device_train_batch_size = 128 completions and gradient_accumulation_steps = 1; steps_per_generation
  defaults to gradient_accumulation_steps (1), so generation_batch_size = 128 and TRL's RepeatSampler hands
  each step 128 // num_generations = 16 prompts, each repeated 8 times. Each step generates those 128
  completions and trains on them once (num_iterations = 1): on-policy, like Molt's synchronous mode.
- Prompts in dataset order (shuffle_dataset False): step k trains on groups 16k .. 16k+15, drawn from
  `env_seed(seed, group)` as Molt's environment draws them.
- scale_rewards "group": GRPO's (r - group mean) / group std. loss_type "dapo": token losses summed over
  the step and divided by its token count, Molt's aggregation. No KL (beta 0), PPO clip CLIP on both sides,
  AdamW at a constant LR without warmup or weight decay, gradient norm clipped at 1.0 (Molt's grad_clip).
- fp32, no gradient checkpointing (TRL turns it on by default; Molt's actor does not checkpoint), HF
  generate on the CPU (no vLLM); torch keeps its default thread count, one per core.

Each JSON line: step; elapsed, seconds since train() was called; reward, the step's mean; generate, the
step's seconds in TRL's generate-and-score (sampling, decoding, rewards, advantages); train, the rest of
the step (loss, backward, optimizer step, logging; at step 1 also train()'s setup); completions, the
completions generated; groups, the prompt groups they came from; reply_tokens, the completions' mean length
(TRL's completions/mean_length).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402


def dataset(seed: int, groups: int) -> Dataset:
    """Prompt groups 0 .. groups-1 as conversational prompts, with their answer and group index."""
    rows = []
    for group in range(groups):
        a, b = workload.operands(numpy.random.default_rng(workload.env_seed(seed, group)))
        rows.append({"prompt": [{"role": "user", "content": workload.prompt(a, b)}], "answer": a + b, "group": group})
    return Dataset.from_list(rows)


def addition_reward(completions, answer, **kwargs) -> list[float]:
    """workload.reward on each reply; a conversational completion is a list of messages."""
    return [workload.reward(completion[-1]["content"], expected) for completion, expected in zip(completions, answer)]


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that adds up its generate-and-score seconds and what each generation batch held."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generate_seconds = 0.0
        self.completions = 0
        self.groups: list[int] = []

    def _generate_and_score_completions(self, inputs):
        started = time.perf_counter()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.generate_seconds += time.perf_counter() - started
            self.completions += len(inputs)
            self.groups = list(dict.fromkeys(self.groups + [row["group"] for row in inputs]))


class StepLog(TrainerCallback):
    """One JSON line per optimizer step (logging_steps=1 logs every step) into `path`; `LOGGED` adds TRL's
    logged values to it (record key -> TRL's log key)."""

    LOGGED: dict[str, str] = {"reply_tokens": "completions/mean_length"}

    def __init__(self, trainer: TimedGRPOTrainer, path: Path):
        self.trainer = trainer
        self.out = path.open("w")
        self.started = self.last = 0.0  # set by start()

    def start(self) -> None:
        self.started = self.last = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:  # the end-of-training summary has no reward
            return
        now = time.perf_counter()
        trainer = self.trainer
        record = {"step": state.global_step, "elapsed": now - self.started, "reward": logs["reward"],
                  "generate": trainer.generate_seconds, "train": now - self.last - trainer.generate_seconds,
                  "completions": trainer.completions, "groups": trainer.groups,
                  **{key: logs.get(name) for key, name in self.LOGGED.items()}}
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
        self.last = now
        trainer.generate_seconds, trainer.completions, trainer.groups = 0.0, 0, []

    def on_train_end(self, args, state, control, **kwargs):
        self.out.close()


def grpo_config(out: Path, seed: int, steps: int, **settings) -> GRPOConfig:
    """The run's GRPOConfig (see the module docstring); `settings` add to it or replace its values."""
    return GRPOConfig(**{**dict(
        output_dir=str(out.parent),  # nothing is saved there (save_strategy "no")
        model_init_kwargs={"dtype": "float32"},
        num_generations=workload.GROUP_SIZE,
        per_device_train_batch_size=workload.GROUPS_PER_STEP * workload.GROUP_SIZE,
        gradient_accumulation_steps=1,
        num_iterations=1,
        temperature=workload.TEMPERATURE,
        learning_rate=workload.LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=workload.CLIP,
        scale_rewards="group",
        loss_type="dapo",
        shuffle_dataset=False,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=seed,
        max_steps=steps,
    ), **settings})


def train(trainer: TimedGRPOTrainer, out: Path, step_log: type[StepLog] = StepLog) -> None:
    """trainer.train(), one JSON line per optimizer step into `out` (elapsed from this call)."""
    log = step_log(trainer, out)
    trainer.add_callback(log)
    log.start()
    trainer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory (workload.build's output)")
    parser.add_argument("--workload", required=True, choices=sorted(workload.WORKLOADS))
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, sampling and initialisation")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--out", required=True, type=Path, help="JSON lines, one per optimizer step")
    parser.add_argument("--groups-per-step", type=int, default=workload.GROUPS_PER_STEP,
                        help="prompt groups per optimizer step (bench/scaling.py varies it)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="most new tokens a reply may take (default: the workload's)")
    args = parser.parse_args()

    config = grpo_config(args.out, args.seed, args.steps,
                         max_completion_length=args.max_tokens or workload.WORKLOADS[args.workload]["max_tokens"],
                         per_device_train_batch_size=args.groups_per_step * workload.GROUP_SIZE)
    trainer = TimedGRPOTrainer(model=args.model, reward_funcs=addition_reward, args=config,
                               train_dataset=dataset(args.seed, args.steps * args.groups_per_step))
    train(trainer, args.out)


if __name__ == "__main__":
    main()
