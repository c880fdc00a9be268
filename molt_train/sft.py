"""`molt-sft`: supervised fine-tuning on molt-train's own trainer.

    molt-sft --data.path chats.jsonl --model DIR --epochs 2
    molt-sft --data.path runs/digit-X/rollouts --data.min_reward 1 --env digit --eval.every 20

The data (`sft_data`): chat JSON lines (`messages`, optional `tools`, images
as data: URLs for a vision-language model), the loss on the assistant's
tokens as the model's own chat template marks them;
or trajectory records (a run's `--log.rollouts`, `molt-serve --trajectories`)
trained on their own token ids and masks, with `--data.min_reward` and
`--data.best_of_group` for rejection-sampling fine-tuning. A share of the
examples (`--data.eval_fraction`) is held out and its loss logged
(`sft/eval_loss`) every `--data.eval_every` steps and at the end; with
`--env`, `--eval.every` also plays held-out episodes on an engine that gets
the weights before each evaluation (`eval/*`).

The trainer is molt-train's: the same ranks and backends (`--actor.*`:
fsdp2 or automodel, precision, activation checkpointing, LoRA), packing into
micro-batches of `--train.micro_batch_tokens`, optimizer and schedule
(`--train.*`), checkpoints in the same format (`RUN_DIR/checkpoints/step_N/
policy/`, which `molt-train --model` and `molt-eval` take), `--resume`, the
progress bar, `metrics.jsonl`, TensorBoard and plots. The loss of a step is
the negative log-likelihood of its trained tokens over their number (each
token counts the same, however the examples are cut into micro-batches);
examples come in a fresh order every epoch, drawn from `--seed`, so a resumed
run takes the batches it would have taken.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from jsonargparse import ArgumentParser

from molt_train.cli import _bare_booleans, check_loadable  # (also sets the parsing of flag help from docstrings)
from molt_train.config import (
    ActorConfig,
    AlgoConfig,
    CkptConfig,
    Config,
    ConfigError,
    EngineConfig,
    EvalConfig,
    LogConfig,
    RayConfig,
    RolloutConfig,
    TrainConfig,
    validate,
)


@dataclass
class DataConfig:
    """What to train on."""

    path: str | None = None
    """A JSON-lines file (.jsonl, .jsonl.gz) or a directory of them: chat conversations or trajectory records."""
    kind: str = "auto"
    """chat, trajectories, or auto (by each file's first record)."""
    last_turn_only: bool = False
    """Chat: train only the last assistant turn of each conversation."""
    min_reward: float | None = None
    """Trajectories: keep the records whose reward is at least this."""
    best_of_group: bool = False
    """Trajectories: keep only the best rollout of each group."""
    batch_size: int = 16
    """Examples per optimizer step."""
    max_tokens: int = 4096
    """Examples longer than this are left out (counted in the start-up report)."""
    eval_fraction: float = 0.05
    """Share of the examples held out for sft/eval_loss (at least one when there are two or more)."""
    eval_every: int = 0
    """Log the held-out loss every this many steps (and at the end); 0 = only at the end."""


@dataclass
class SFTConfig:
    """A supervised fine-tuning run."""

    data: DataConfig = field(default_factory=DataConfig)
    model: str | None = None
    """Model directory (Hugging Face format); default: the built-in tiny chat model."""
    epochs: int = 1
    """Passes over the training examples (unless --steps)."""
    steps: int = 0
    """Optimizer steps; 0 = --epochs passes."""
    env: str | None = None
    """An environment whose held-out episodes --eval.* plays during the run; none: no episodes."""
    out: str | None = None
    """Run directory (default: runs/sft-<time>)."""
    resume: bool = False
    """Continue the run in --out from its latest checkpoint."""
    seed: int = 0
    """Random seed: the held-out split, the order of examples, initialisation."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-4))
    actor: ActorConfig = field(default_factory=ActorConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The evaluation episodes' reply limits (with --env)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The evaluation engine (with --env)."""
    ray: RayConfig = field(default_factory=RayConfig)


def run_config(config: SFTConfig, steps: int) -> Config:
    """The molt-train `Config` the trainer, checkpoints and metrics take: no KL, no entropy, no rollout
    engine unless evaluation episodes need one (which gets the weights whole before each evaluation)."""
    return Config(env=config.env or "digit", model=config.model, steps=steps, out=config.out, resume=config.resume,
                  seed=config.seed, train=replace(config.train, async_queue_size=0, weight_sync="object_store"),
                  algo=AlgoConfig(kl_coef=0.0, entropy_coef=0.0), actor=config.actor, ckpt=config.ckpt,
                  log=replace(config.log, rollouts=False), eval=config.eval,
                  rollout=replace(config.rollout, max_total_tokens=max(config.rollout.max_total_tokens,
                                                                       config.data.max_tokens)),
                  engine=replace(config.engine, data_parallel_size=config.engine.data_parallel_size if config.env
                                 else 0),
                  ray=config.ray)


def split(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(training, held-out) examples: a seeded shuffle, the held-out share at the end."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held = min(max(round(len(examples) * fraction), 1 if fraction > 0 and len(examples) > 1 else 0),
               len(examples) - 1)
    return [examples[i] for i in order[:len(order) - held]], [examples[i] for i in order[len(order) - held:]]


def batch(examples: list, size: int, step: int, seed: int) -> list:
    """The examples of optimizer step `step` (0-based): epoch after epoch, each in a fresh seeded order."""
    start = step * size
    chosen = []
    while len(chosen) < size:
        epoch, offset = divmod(start + len(chosen), len(examples))
        order = _order(len(examples), seed, epoch)
        chosen += [examples[i] for i in order[offset:offset + size - len(chosen)]]
    return chosen


@functools.lru_cache(maxsize=2)
def _order(count: int, seed: int, epoch: int) -> list[int]:
    """Epoch `epoch`'s order of `count` examples (a step may end one epoch and start the next)."""
    order = list(range(count))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return order


def items(examples: list) -> list:
    from molt_train.packing import TrainItem

    return [TrainItem(token_ids=e.token_ids, mask=e.mask, logprobs=[0.0] * len(e.token_ids),
                      ages=[0] * len(e.token_ids), advantage=1.0, routes=e.routes, images=e.images)
            for e in examples]


async def train(config: SFTConfig, run_dir: Path, model_dir: str, examples: list, held: list, console) -> None:
    from molt_train import checkpoint
    from molt_train.evaluate import Evaluator
    from molt_train.metrics import Metrics, plot
    from molt_train.runtime import Runtime

    steps = config.steps or config.epochs * math.ceil(len(examples) / config.data.batch_size)
    run = run_config(config, steps)
    resume_from = checkpoint.latest(run_dir) if config.resume else None
    state = checkpoint.load_state(resume_from) if resume_from else {
        "step": 0, "version": 0, "data": {"next_index": 0, "redo": []}}
    runtime = await Runtime.start(run, model_dir, resume_from, state, console, sft=True)
    metrics = Metrics(run_dir, run, resume_step=state["step"])
    evaluator = Evaluator(run, runtime.workers, recover=runtime.check_workers) if config.env else None
    step, version = state["step"], state["version"]
    progress = console.progress(steps, step)
    began = time.perf_counter()
    try:
        if step == 0 and evaluator is not None and evaluator.due(0):  # the engine holds the initial weights
            metrics.log(0, await evaluator.run())
        while step < steps:
            started = time.perf_counter()
            stats = await runtime.trainer.step(items(batch(examples, config.data.batch_size, step, config.seed)))
            step += 1
            record = {"sft/loss": stats.loss_sum / max(stats.tokens, 1), "tokens/trained": stats.tokens,
                      "grad_norm": stats.grad_norm, "sft/epoch": step * config.data.batch_size / len(examples)}
            if held and (step == steps or (config.data.eval_every and step % config.data.eval_every == 0)):
                record["sft/eval_loss"] = await runtime.trainer.nll(items(held))
            if evaluator is not None and evaluator.due(step):
                version = await runtime.sync_weights()
                record |= await evaluator.run()
            ended = time.perf_counter()
            record |= {"time/step": ended - started, "time/elapsed": ended - began}
            metrics.log(step, record)
            progress.update(1)
            progress.set_postfix(loss=f"{record['sft/loss']:.3f}", refresh=False)
            if step == steps or (config.ckpt.every and step % config.ckpt.every == 0):
                await checkpoint.save(runtime.trainer, run_dir, model_dir, {
                    "step": step, "version": version, "data": state["data"], "seed": config.seed}, config.ckpt.keep)
    finally:
        progress.close()
        metrics.close()
        await runtime.close()
    console.say(f"plots: {plot(run_dir)}")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="molt-sft", description="Supervised fine-tuning on molt-train's trainer.",
                            default_env=False)
    parser.add_class_arguments(SFTConfig, nested_key=None, as_group=False)
    return parser


def check(config: SFTConfig) -> None:
    """The flags molt-sft adds checked, and the trainer's as molt-train checks them; a ConfigError names the
    flag."""
    data = config.data
    for flag, ok, why in (("data.path", data.path is not None, "give a JSON-lines file or a directory of them"),
                          ("data.kind", data.kind in ("auto", "chat", "trajectories"), "chat, trajectories or auto"),
                          ("data.batch_size", data.batch_size >= 1, "must be >= 1"),
                          ("data.max_tokens", data.max_tokens >= 2, "must be >= 2"),
                          ("data.eval_fraction", 0 <= data.eval_fraction < 1, "must be in [0, 1)"),
                          ("data.eval_every", data.eval_every >= 0, "must be >= 0"),
                          ("epochs", config.epochs >= 1, "must be >= 1"), ("steps", config.steps >= 0, "must be >= 0"),
                          ("eval.every", not config.eval.every or config.env, "plays episodes: give --env"),
                          ("eval.at_start", not config.eval.at_start or config.env, "plays episodes: give --env")):
        if not ok:
            raise ConfigError(f"--{flag}: {why}")
    validate(replace(run_config(config, 1), engine=replace(config.engine, data_parallel_size=1)))
    if config.env:
        check_loadable(run_config(config, 1))


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from molt_agents.multimodal import Vision
    from molt_agents.tiny import model_dir as named_model_dir
    from molt_train.console import Console
    from molt_train.sft_data import load_examples

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        config = SFTConfig(**vars(parser.instantiate(parser.parse_args(_bare_booleans(argv, SFTConfig)))))
        check(config)
        model_dir = str(named_model_dir(config.model))
        data = config.data
        vision = Vision(model_dir) if Vision.available(model_dir) else None
        found = load_examples(data.path, AutoTokenizer.from_pretrained(model_dir), data.kind, data.last_turn_only,
                              data.min_reward, data.best_of_group, vision)
    except (ConfigError, ValueError) as error:
        sys.exit(f"molt-sft: {error}")
    fitting = [example for example in found if len(example.token_ids) <= data.max_tokens]
    if not fitting:
        sys.exit(f"molt-sft: --data.max_tokens {data.max_tokens}: every example is longer")
    examples, held = split(fitting, data.eval_fraction, config.seed)
    run_dir = Path(config.out or f"runs/sft-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_dir.exists() and not config.resume and any(run_dir.glob("checkpoints/step_*")):
        sys.exit(f"molt-sft: {run_dir} already holds a run; pass --resume to continue it or a new --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "sft_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))
    console = Console(run_dir, config.log.verbose, prog="molt-sft")
    console.say(f"# run {run_dir}: {len(examples)} training and {len(held)} held-out examples from {data.path} "
                f"({sum(sum(e.mask) for e in examples)} trained tokens; {len(found) - len(fitting)} longer than "
                f"--data.max_tokens left out), model {model_dir}")
    try:
        asyncio.run(train(config, run_dir, model_dir, examples, held, console))
    except KeyboardInterrupt:
        console.say(f"molt-sft: interrupted; continue with --out {run_dir} --resume")
        sys.exit(130)
    except Exception as error:
        console.say(console.failed(error))
        console.say(f"continue from the last checkpoint with --out {run_dir} --resume")
        sys.exit(1)


if __name__ == "__main__":
    main()
