"""Run observability: metrics.jsonl, TensorBoard, W&B, PNG plots.

One JSON object per optimizer step in `RUN_DIR/metrics.jsonl` (after a resume,
steps already logged are not logged again); the same scalars go to
TensorBoard (and W&B when enabled); evaluations (`eval/*`, `time/eval`) join
the line of the step they follow, the one before training as step 0. `plot`
draws reward (training and evaluation), lengths and timings
from the JSON lines into `RUN_DIR/plots/`.
"""

from __future__ import annotations

import json
from pathlib import Path


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
        self.wandb = None
        if config.log.wandb:
            import wandb  # optional: pip install wandb

            self.wandb = wandb.init(project="molt", dir=str(run_dir), config=_plain(config), resume="allow")

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

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(config) -> dict:
    import dataclasses

    return dataclasses.asdict(config)


PANELS = [
    ("reward", ["reward/mean", "eval/reward"]),  # training (sampled, trained on) and held-out evaluation
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
    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for axis, (title, keys) in zip(axes, PANELS):
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


def main(argv: list[str] | None = None) -> None:
    """`molt-plot RUN_DIR [RUN_DIR ...]`: (re)draw the plots of runs, finished or in progress."""
    import argparse

    parser = argparse.ArgumentParser(prog="molt-plot", description=main.__doc__)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            parser.error(f"{run_dir / 'metrics.jsonl'} does not exist: is {run_dir} a molt-train run directory?")
        print(plot(run_dir))


if __name__ == "__main__":
    main()
