"""Run observability: metrics.jsonl, TensorBoard, W&B, PNG plots.

One JSON object per optimizer step in `RUN_DIR/metrics.jsonl` (after a resume,
steps already logged are not logged again); the same scalars go to
TensorBoard (and W&B when enabled); evaluations (`eval/*`, `time/eval`) join
the line of the step they follow, the one before training as step 0. W&B
also gets the config and, per step, a table of a few of its episodes
(`Metrics.episodes`). `plot` draws reward (training and evaluation),
lengths, timings and the environment's own episode facts (`env/*`, when the
environment reports any) from the JSON lines into `RUN_DIR/plots/`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import uuid
from pathlib import Path

from molt_agents.multimodal import is_image_part


class Metrics:
    def __init__(self, run_dir: Path, config, resume_step: int = 0):
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():  # keep only the steps the checkpoint covers
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.tensorboard = None
        if config.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)
        self.wandb = _start_wandb(run_dir, config) if config.log.wandb else None
        self.wandb_episodes = config.log.wandb_episodes

    def log(self, step: int, values: dict) -> None:
        record = {"step": step, **values}
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def episodes(self, step: int, groups: list) -> None:
        """Log up to `log.wandb_episodes` of the step's episodes (`molt_train.group.Group`s) to W&B as the table
        `episodes`: step, prompt, reply, reward. One episode of each group in turn, so that the table shows
        different prompts before more samples of one; episodes without chat messages are left out."""
        if self.wandb is None or not self.wandb_episodes:
            return
        import wandb

        per_group = [[t for t in {t.rollout_id: t for t in group.trajectories}.values() if t.messages]
                     for group in groups]  # one trajectory per episode: its segments share messages and reward
        chosen = [t for turn in itertools.zip_longest(*per_group) for t in turn if t is not None]
        rows = [[step, *prompt_and_reply(t.messages), t.reward] for t in chosen[:self.wandb_episodes]]
        if rows:
            self.wandb.log({"episodes": wandb.Table(columns=["step", "prompt", "reply", "reward"], data=rows)},
                           step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(run_dir: Path, config):
    """The run's W&B run: in the project WANDB_PROJECT (default molt), named after the run directory, with the
    whole config (sections as nested dicts). Its id is kept in RUN_DIR/wandb_id, so that `--resume` continues
    the same W&B run rather than starting a second one."""
    import wandb  # optional: pip install 'molt[wandb]'

    id_file = run_dir / "wandb_id"
    if config.resume and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex
        id_file.write_text(run_id + "\n")
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "molt"), name=run_dir.name, id=run_id,
                      resume="allow", dir=str(run_dir), config=dataclasses.asdict(config))


def prompt_and_reply(messages: list[dict]) -> tuple[str, str]:
    """An episode's chat as two texts: the messages before the first assistant reply, and the rest (replies,
    tool calls, tool results, later observations)."""
    first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return _chat_text(messages[:first_reply]), _chat_text(messages[first_reply:])


def _chat_text(messages: list[dict]) -> str:
    """Chat messages as text, each headed by its role; images as [image], tool calls as name(arguments)."""
    def part_text(part) -> str:
        if isinstance(part, str):
            return part
        return "[image]" if is_image_part(part) else part.get("text", f"[{part.get('type')}]")

    def message_text(message: dict) -> str:
        content = message.get("content")
        text = "".join(map(part_text, content)) if isinstance(content, list) else content or ""
        calls = [f"{call['function']['name']}({call['function'].get('arguments', '')})"
                 for call in message.get("tool_calls") or []]
        return "\n".join(filter(None, [text, *calls]))

    return "\n\n".join(f"[{message.get('role')}] {message_text(message)}" for message in messages)


PANELS = [
    ("reward", ["reward/mean", "eval/reward"]),  # training (sampled, trained on) and held-out evaluation
    ("supervised loss (nats per token)", ["sft/loss", "sft/eval_loss"]),  # molt-sft
    ("response length (tokens)", ["response_len/mean"]),
    ("seconds per step", ["time/step", "time/generate", "time/wait", "time/train", "time/sync", "time/eval"]),
    ("trainer seconds per step", ["time/forward_backward", "time/logprobs", "time/optimizer", "time/ray"]),
    ("trainer vs engine", ["mismatch/kl", "offpolicy/kl", "is/filtered_frac"]),
]


def plot(run_dir: Path) -> Path:
    """Draw the run's curves from metrics.jsonl into RUN_DIR/plots/metrics.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    env_keys = sorted({key for record in records for key in record if key.startswith("env/")})
    panels = [(title, keys) for title, keys in PANELS + [("environment (episode info, mean)", env_keys)]
              if any(record.get(key) is not None for record in records for key in keys)] or PANELS[:1]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    axes = axes[0]
    for axis, (title, keys) in zip(axes, panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:  # evaluations are a few steps apart: marked, not just joined
                axis.plot(*zip(*points), label=key, marker="o" if "eval" in key else None, markersize=3)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.legend(fontsize=7)
    figure.tight_layout()
    out = run_dir / "plots" / "metrics.png"
    out.parent.mkdir(exist_ok=True)
    figure.savefig(out, dpi=90)
    plt.close(figure)
    return out


def rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the up to `window - 1` values before it."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def compare(run_dirs: list[Path], out: Path, key: str = "reward/mean", window: int = 10) -> Path:
    """Draw `key` of several runs in one plot (a rolling mean over `window` steps), against the step and
    against the seconds of training, each run labelled by its directory's name: a run and its controls."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for run_dir in run_dirs:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        records = [r for r in records if r.get(key) is not None]
        smooth = rolling_mean([r[key] for r in records], window)
        axes[0].plot([r["step"] for r in records], smooth, label=run_dir.name)
        axes[1].plot([r.get("time/elapsed", 0.0) for r in records], smooth, label=run_dir.name)
    for axis, xlabel in zip(axes, ["step", "seconds of training"]):
        axis.set_title(f"{key}, mean of the last {window} steps")
        axis.set_xlabel(xlabel)
        axis.legend(fontsize=7)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> None:
    """`molt-plot RUN_DIR [RUN_DIR ...]`: (re)draw the plots of runs, finished or in progress; with
    `--compare OUT.png`, one plot of their rewards side by side instead."""
    import argparse

    parser = argparse.ArgumentParser(prog="molt-plot", description=main.__doc__)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--compare", type=Path, metavar="OUT.png",
                        help="draw the runs' rewards (rolling mean) in one plot, into this file")
    parser.add_argument("--key", default="reward/mean", help="the metric --compare draws (default: reward/mean)")
    parser.add_argument("--window", type=int, default=10, help="steps in --compare's rolling mean (default: 10)")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            parser.error(f"{run_dir / 'metrics.jsonl'} does not exist: is {run_dir} a molt-train run directory?")
    if args.window < 1:
        parser.error(f"--window {args.window}: must be >= 1")
    if args.compare:
        print(compare(args.run_dirs, args.compare, args.key, args.window))
        return
    for run_dir in args.run_dirs:
        print(plot(run_dir))


if __name__ == "__main__":
    main()
