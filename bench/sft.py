"""Benchmark: molt-sft against TRL's SFTTrainer on the same data, model and settings.

    .venv/bin/python bench/sft.py [--seeds 0 1] [--steps 200]

Runs in Molt's .venv. The model is bench/run.py's small workload (built once into bench/results/models/);
the data, 4096 chats "a+b=" -> the sum (bench/workload.py's prompts, the operands drawn from
`random.Random(1234)`), the same file for both sides. Each side trains BATCH examples per step, AdamW at a
constant LR without warmup or weight decay, gradient norm clipped at 1.0, fp32, the loss on the
assistant's reply and its end-of-turn token (molt-sft: as the chat template marks them; TRL: the
completion of a prompt-completion pair of texts cut at the same place, see bench/trl_sft.py). TRL runs in
bench/.venv-trl (bench/trl_sft.py). The runs alternate per seed (trl, molt); the table gives the mean
loss of the last 20 steps and the seconds per step (wall clock of the training loop over its steps,
molt-sft's from its first step's start), and `bench/results/sft-<timestamp>/runs.json` every step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import workload  # noqa: E402
from run import RESULTS, TRL_PYTHON, machine, model  # noqa: E402

BATCH, LR, EXAMPLES = 32, 1e-3, 4096


def write_data(path: Path) -> Path:
    rng = random.Random(1234)
    with path.open("w") as out:
        for _ in range(EXAMPLES):
            a, b = rng.randrange(10), rng.randrange(10)
            out.write(json.dumps({"messages": [{"role": "user", "content": workload.prompt(a, b)},
                                               {"role": "assistant", "content": str(a + b)}]}) + "\n")
    return path


def run_trl(model_dir: Path, data: Path, seed: int, steps: int, out: Path) -> list[dict]:
    log = out / "trl.jsonl"
    subprocess.run([str(TRL_PYTHON), str(BENCH / "trl_sft.py"), "--model", str(model_dir), "--data", str(data),
                    "--seed", str(seed), "--steps", str(steps), "--out", str(log)], check=True,
                   stdout=(out / "trl.log").open("w"), stderr=subprocess.STDOUT)
    return [json.loads(line) for line in log.read_text().splitlines()]


def run_molt(model_dir: Path, data: Path, seed: int, steps: int, out: Path) -> list[dict]:
    run_dir = out / "molt"
    subprocess.run([sys.executable, "-m", "molt_train.sft", "--model", str(model_dir), "--data.path", str(data),
                    "--data.batch_size", str(BATCH), "--data.eval_fraction", "0", "--steps", str(steps),
                    "--train.lr", str(LR), "--train.lr_schedule", "constant", "--train.warmup_steps", "0",
                    "--train.weight_decay", "0", "--train.grad_clip", "1.0", "--ckpt.every", "0",
                    "--log.tensorboard", "false", "--seed", str(seed), "--out", str(run_dir)], check=True,
                   stdout=(out / "molt.log").open("w"), stderr=subprocess.STDOUT)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "loss": r["sft/loss"], "elapsed": r["time/elapsed"]} for r in rows]


def summary(rows: list[dict]) -> tuple[float, float]:
    """(mean loss of the last 20 steps, seconds per step after the first)."""
    last = [r["loss"] for r in rows[-20:]]
    return statistics.mean(last), (rows[-1]["elapsed"] - rows[0]["elapsed"]) / (len(rows) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if subprocess.run(["bash", str(BENCH / "setup_trl.sh")]).returncode != 0:
        sys.exit("bench: bench/setup_trl.sh failed (see above)")
    out = RESULTS / f"sft-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True)
    model_dir, data = model("small"), write_data(out / "chats.jsonl")
    runs, lines = {}, []
    for seed in args.seeds:
        for system, run in (("trl", run_trl), ("molt-sft", run_molt)):
            where = out / f"{system}-s{seed}"
            where.mkdir()
            rows = run(model_dir, data, seed, args.steps, where)
            runs[f"{system}-s{seed}"] = rows
            loss, per_step = summary(rows)
            lines.append(f"| {system} | {seed} | {rows[0]['loss']:.3f} | {loss:.4f} | {per_step:.3f} |")
            print(lines[-1], flush=True)
    table = "\n".join([f"{machine()}; small workload, {args.steps} steps of {BATCH} chats, lr {LR}", "",
                       "| system | seed | first step's loss | last 20 steps' loss | s/step |", "|---|---|---|---|---|",
                       *lines])
    (out / "table.md").write_text(table + "\n")
    (out / "runs.json").write_text(json.dumps(runs))
    print(table)


if __name__ == "__main__":
    main()
