"""The benchmark's report from runs.json (bench/run.py): a table per workload and the reward plot.

`write(data, out)` writes out/table.md and out/plot.png and returns the table.
Each run's raw records become steps of {elapsed, reward, rollout, train, sync}:

- trl (bench/trl_run.py's lines): elapsed since train() was called; rollout,
  TRL's generate-and-score of the step; train, the rest of the step; no sync
  (one process holds the only copy of the weights).
- molt, molt-sync (metrics.jsonl): elapsed is time/elapsed (since the loop
  began) where logged, else the running sum of time/wait + time/train +
  time/sync; rollout is time/wait, the seconds the trainer waited for the
  step's rollouts (all of their generation when synchronous, only what
  training did not hide when asynchronous); train is time/train; sync is
  time/sync.

A step's time is the difference of consecutive elapsed values; per-step
figures are medians after the first WARMUP_STEPS steps (startup, a first
cache fill), taken per seed, then averaged over the seeds.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

WARMUP_STEPS = 10
REWARD_WINDOW = 30  # steps averaged at each end of a run
SMOOTHING = 10  # steps in the plot's rolling mean
LINESTYLES = ["-", "--", ":", "-."]  # one per seed


def steps(run: dict) -> list[dict]:
    """A run's records, one per optimizer step, in the common shape (None where not measured)."""
    if run["system"] == "trl":
        return [{"elapsed": r["elapsed"], "reward": r["reward"], "rollout": r["generate"], "train": r["train"],
                 "sync": None} for r in run["records"]]
    total, out = 0.0, []
    for r in run["records"]:
        total += r["time/wait"] + r["time/train"] + r["time/sync"]
        out.append({"elapsed": r.get("time/elapsed", total), "reward": r["reward/mean"], "rollout": r["time/wait"],
                    "train": r["time/train"], "sync": r["time/sync"]})
    return out


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary(run: dict, warmup: int = WARMUP_STEPS) -> dict:
    """One run's figures: loop and process wall clock, per-step medians after the first `warmup` steps, reward
    at the start and the end."""
    rows = steps(run)
    elapsed = [row["elapsed"] for row in rows]
    durations = [now - before for before, now in zip([0.0] + elapsed, elapsed)]
    settled = slice(warmup, None) if len(rows) > warmup else slice(None)
    rewards = [row["reward"] for row in rows]
    return {"wall": elapsed[-1], "process": run["process_seconds"], "s_per_step": _median(durations[settled]),
            **{key: _median(row[key] for row in rows[settled]) for key in ("rollout", "train", "sync")},
            "reward_first": _mean(rewards[:REWARD_WINDOW]), "reward_last": _mean(rewards[-REWARD_WINDOW:])}


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.3f}"


def _reward(first: float | None, last: float | None) -> str:
    return "-" if first is None or last is None else f"{first:.2f} -> {last:.2f}"


def _ratio(x: float | None, reference: float | None) -> str:
    return "-" if x is None or not reference else f"{x / reference:.2f}x"


def table(data: dict) -> str:
    steps_run = data["steps"]
    lines = [f"# Molt and TRL: {steps_run} steps, seeds {', '.join(map(str, data['seeds']))}", "",
             f"Machine: {data['machine']}.", "",
             f"Wall: the training loop's seconds for the {steps_run} steps; process: the whole command, startup "
             f"included (means over seeds). Per step: medians after the first {WARMUP_STEPS} steps, averaged over "
             "seeds. rollout: TRL's generate-and-score; Molt's wait for rollouts (time/wait). Reward: mean of the "
             f"first and the last {REWARD_WINDOW} steps, over seeds, then per seed.", ""]
    header = ["system", f"wall, {steps_run} steps (s)", "process (s)", "s/step", "rollout s/step", "train s/step",
              "sync s/step", "s/step / TRL's", "wall / TRL's", f"reward first {REWARD_WINDOW} -> last {REWARD_WINDOW}"]
    for name in data["workloads"]:
        by_system = {system: [(run["seed"], summary(run)) for run in data["runs"]
                              if run["workload"] == name and run["system"] == system] for system in data["systems"]}
        means = {system: {key: _mean(s[key] for _, s in runs) for key in runs[0][1]}
                 for system, runs in by_system.items() if runs}
        trl = means.get("trl", {})
        lines += [f"## {name}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for system, mean in means.items():
            seeds = "; ".join(f"seed {seed}: {_reward(s['reward_first'], s['reward_last'])}"
                              for seed, s in by_system[system])
            against = ["-", "-"] if system == "trl" else [_ratio(mean["s_per_step"], trl.get("s_per_step")),
                                                          _ratio(mean["wall"], trl.get("wall"))]
            cells = [system, _seconds(mean["wall"]), _seconds(mean["process"]), _seconds(mean["s_per_step"]),
                     _seconds(mean["rollout"]), _seconds(mean["train"]), _seconds(mean["sync"]), *against,
                     f"{_reward(mean['reward_first'], mean['reward_last'])} ({seeds})"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _rolling_mean(values: list) -> list[float]:
    """Trailing mean over SMOOTHING steps (fewer at the start), skipping unmeasured steps."""
    means = [_mean(values[max(0, i + 1 - SMOOTHING):i + 1]) for i in range(len(values))]
    return [math.nan if m is None else m for m in means]


def plot(data: dict, path: Path) -> None:
    """Reward against wall-clock seconds, one panel per workload, one line per system and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data["workloads"]), figsize=(6 * len(data["workloads"]), 4), squeeze=False)
    for ax, name in zip(axes[0], data["workloads"]):
        for run in data["runs"]:
            if run["workload"] != name:
                continue
            rows = steps(run)
            ax.plot([row["elapsed"] for row in rows], _rolling_mean([row["reward"] for row in rows]),
                    color=f"C{data['systems'].index(run['system'])}",
                    linestyle=LINESTYLES[data["seeds"].index(run["seed"]) % len(LINESTYLES)],
                    label=f"{run['system']} seed {run['seed']}")
        ax.set(title=name, xlabel="seconds since the training loop began",
               ylabel=f"reward (rolling mean of {SMOOTHING} steps)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(data: dict, out: Path) -> str:
    text = table(data)
    (out / "table.md").write_text(text)
    plot(data, out / "plot.png")
    return text
