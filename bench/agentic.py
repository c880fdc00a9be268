"""The agentic benchmark: Molt and TRL's GRPOTrainer on a multi-turn tool task, with and without tool latency.

    .venv/bin/python bench/agentic.py [--systems trl molt molt-loopback] [--latencies 0ms 100ms] [--seeds 0 1]
                                      [--steps 300] [--wall-cap 300] [--cpu-lock /tmp/molt-cpu.lock]

Runs in Molt's .venv. The task is `locker` (environments/locker.py; its
Molt-free copy bench/locker_task.py): up to 3 replies, a `lookup` tool whose
calls wait the latency (bench/locker_task.LATENCIES: time, not CPU) before
the model reads their results. The systems, on the same model (tiny:agent),
episodes and settings:

- trl: bench/trl_agentic.py, GRPOTrainer's own tool calling (`environment_factory`);
- molt: molt-train, asynchronous, the env runner playing bench/locker_env.py:Locker<latency>;
- molt-loopback: the same, the episodes played by a stock `openai` client agent through the loopback
  (bench/locker_env.py:LockerAgent<latency>).

Both sides: 16 groups of 8 per step, 32 new tokens a reply within 1024
tokens an episode, temperature 1, GRPO advantages, no KL, clip 0.2, fp32,
AdamW at a constant LR with no warmup or weight decay, gradient norm clipped
at 1.0; Molt keeps every group (`--algo.filter_zero_variance false`, as TRL)
and runs two engines (`--engine.data_parallel_size 2`, the locker recipe's,
so the agent's Python runs on both cores). A run ends at --steps or when its
process has run --wall-cap seconds (SIGTERM; Molt saves its last step), so a
slow system is compared on the steps it did, and on reward against seconds.

Runs alternate: every system and latency for one seed before the next seed.
Into bench/results/agentic-<timestamp>/: runs/<latency>-<system>-seed<s>/,
runs.json (rewritten after each run), table.md and plot.png (reward against
seconds since the training loop began, one panel per latency).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import locker_task  # noqa: E402
import report  # noqa: E402
import run  # noqa: E402

# A tenth of the locker recipe's peak (recipes/locker.yaml: 3e-3 after 30 warmup steps, with a KL penalty):
# at 3e-3 constant without KL both sides collapsed within 60 steps into replies without tool calls, which
# would take away the tool calls this benchmark measures (docs/experiments/agentic-bench.md). Constant,
# since a capped run's last step is not known in advance.
LR = 3e-4
MAX_TOKENS = 32  # new tokens a reply
MAX_TOTAL_TOKENS = 1024  # an episode, prompt included
ENGINES = 2
ATTEMPTS = 2  # a run that fails before its first step (on a shared machine, Ray's start) is run again once


def trl_command(model: Path, latency: str, seed: int, steps: int, run_dir: Path) -> list[str]:
    return [str(run.TRL_PYTHON), str(BENCH / "trl_agentic.py"), "--model", str(model), "--latency", latency,
            "--seed", str(seed), "--steps", str(steps), "--lr", str(LR), "--out", str(run_dir / "steps.jsonl")]


def molt_command(model: Path, latency: str, seed: int, steps: int, run_dir: Path,
                 env: str | None = None) -> list[str]:
    return run.molt_command(model, None, seed, steps, run_dir, env=env or f"bench/locker_env.py:Locker{latency}",
                            max_tokens=MAX_TOKENS, lr=LR) + [
        "--rollout.max_total_tokens", str(MAX_TOTAL_TOKENS), "--algo.filter_zero_variance", "false",
        "--engine.data_parallel_size", str(ENGINES)]


def molt_loopback_command(model: Path, latency: str, seed: int, steps: int, run_dir: Path) -> list[str]:
    return molt_command(model, latency, seed, steps, run_dir, env="locker") + [
        "--agent", f"bench/locker_env.py:LockerAgent{latency}"]


# system -> (command, the file of its per-step JSON lines, the record's key of tool calls per episode)
SYSTEMS = {
    "trl": (trl_command, "steps.jsonl", "tool_calls"),
    "molt": (molt_command, "metrics.jsonl", "env/tool_calls"),
    "molt-loopback": (molt_loopback_command, "metrics.jsonl", "env/tool_calls"),
}


@contextmanager
def cpu_lock(path: str | None):
    """Hold `path` (flock, as flock(1) takes it) while a run uses the CPU, so that other jobs which take
    the same lock wait for it, and it for them, between runs rather than during one."""
    if path is None:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --------------------------------------------------------------------------
# The report


def tool_calls(run_data: dict) -> float | None:
    """Tool calls per episode over the run's last REWARD_WINDOW steps."""
    key = SYSTEMS[run_data["system"]][2]
    return report._mean(r.get(key) for r in run_data["records"][-report.REWARD_WINDOW:])


def _cell(values: list, fmt) -> str:
    """The mean over seeds, then each seed's value."""
    mean = report._mean(values)
    return "-" if mean is None else f"{fmt(mean)} ({' / '.join('-' if v is None else fmt(v) for v in values)})"


def common_reward(run_data: dict, steps: int) -> float | None:
    """Mean reward over steps `steps` - REWARD_WINDOW + 1 .. `steps`: the same steps on every system."""
    rewards = [row["reward"] for row in report.steps(run_data)[:steps]]
    return report._mean(rewards[-report.REWARD_WINDOW:])


def table(data: dict) -> str:
    window = report.REWARD_WINDOW
    lines = [f"# Agentic workload (locker): Molt and TRL, {data['wall_cap']:.0f} s or {data['steps']} steps a run, "
             f"seeds {', '.join(map(str, data['seeds']))}", "", f"Machine: {data['machine']}.", "",
             f"steps: optimizer steps done within the cap. s/step: median after the first {report.WARMUP_STEPS} "
             f"steps. process: the command's wall clock, startup and shutdown included. Reward: mean of the first "
             f"and the last {window} steps done. Tool calls per episode over the last {window} steps. Each: the "
             f"mean over seeds, then per seed. Reward at common steps: the mean over the last {window} of the steps "
             "that every system did at this latency and seed (the fewest any of them did), so the systems are "
             "compared at the same steps.", ""]
    header = ["system", "steps", "s/step", "s/step / TRL's", "process (s)", f"reward first {window} -> last {window}",
              "reward at common steps", "tool calls / episode"]
    for latency in data["latencies"]:
        done = [r for r in data["runs"] if r["workload"] == f"locker-{latency}" and r["records"]]
        common = {seed: min(len(r["records"]) for r in done if r["seed"] == seed) for seed in {r["seed"] for r in done}}
        lines += [f"## {latency} a tool call (common steps: "
                  f"{', '.join(f'seed {seed}: {n}' for seed, n in sorted(common.items()))})", "",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        trl_step = None
        for system in data["systems"]:
            runs = [r for r in data["runs"] if r["workload"] == f"locker-{latency}" and r["system"] == system
                    and r["records"]]
            if not runs:
                continue
            summaries = [report.summary(r) for r in runs]
            step = report._mean(s["s_per_step"] for s in summaries)
            trl_step = step if system == "trl" else trl_step
            lines.append("| " + " | ".join([
                system, _cell([len(r["records"]) for r in runs], lambda x: f"{x:.0f}"),
                _cell([s["s_per_step"] for s in summaries], report._seconds),
                "-" if system == "trl" else report._ratio(step, trl_step),
                _cell([s["process"] for s in summaries], report._seconds),
                report._reward(report._mean(s["reward_first"] for s in summaries),
                               report._mean(s["reward_last"] for s in summaries)) + " (" + "; ".join(
                    report._reward(s["reward_first"], s["reward_last"]) for s in summaries) + ")",
                _cell([common_reward(r, common[r["seed"]]) for r in runs], lambda x: f"{x:.2f}"),
                _cell([tool_calls(r) for r in runs], lambda x: f"{x:.2f}")]) + " |")
        lines.append("")
    return "\n".join(lines)


def write(data: dict, out: Path) -> str:
    text = table(data)
    (out / "table.md").write_text(text)
    report.plot({**data, "runs": [r for r in data["runs"] if r["records"]]}, out / "plot.png")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS),
                        help="systems to run, in this order for each seed and latency")
    parser.add_argument("--latencies", nargs="+", default=list(locker_task.LATENCIES),
                        choices=list(locker_task.LATENCIES), help="tool latencies")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="seeds, each run by every system")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run, at most")
    parser.add_argument("--wall-cap", type=float, default=300, help="seconds a run's process may take, at most")
    parser.add_argument("--cpu-lock", default=None, help="a lock file (flock) to hold during each run")
    parser.add_argument("--model", default="tiny:agent",
                        help="the model: tiny:agent, or its directory (a build of another commit's code)")
    args = parser.parse_args()

    from molt_agents.tiny.build import model_dir

    with cpu_lock(args.cpu_lock):
        model = model_dir(args.model)  # tiny:agent is built once, cached (a few minutes the first time)
    if "trl" in args.systems and subprocess.run(["bash", str(BENCH / "setup_trl.sh")]).returncode != 0:
        sys.exit("agentic: bench/setup_trl.sh failed (see above)")
    out = run.RESULTS / time.strftime("agentic-%Y%m%d-%H%M%S")
    data = {"machine": run.machine(), "model": str(model), "lr": LR, "steps": args.steps, "wall_cap": args.wall_cap,
            "latencies": args.latencies, "workloads": [f"locker-{latency}" for latency in args.latencies],
            "seeds": args.seeds, "systems": args.systems, "runs": []}
    total = len(args.seeds) * len(args.latencies) * len(args.systems)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # environment_factory's "experimental" warning, in every TRL run
    for seed in args.seeds:
        for latency in args.latencies:
            for system in args.systems:
                command_of, records_file, _ = SYSTEMS[system]
                run_dir = out / "runs" / f"{latency}-{system}-seed{seed}"
                print(f"agentic: [{len(data['runs']) + 1}/{total}] {system} {latency} seed {seed}", end="", flush=True)
                for attempt in range(1, ATTEMPTS + 1):
                    with cpu_lock(args.cpu_lock):
                        result = run.run_command(command_of(model, latency, seed, args.steps, run_dir), run_dir,
                                                 records_file, wall_cap=args.wall_cap)
                    if result["records"] or attempt == ATTEMPTS:
                        break
                    print(f" (failed before its first step; again, the failure in {run_dir}-failed)", end="",
                          flush=True)
                    run_dir.rename(f"{run_dir}-failed")
                data["runs"].append({"workload": f"locker-{latency}", "system": system, "seed": seed, **result})
                (out / "runs.json").write_text(json.dumps(data, indent=1))
                stopped = "stopped at the cap" if result["capped"] else f"exit {result['returncode']}"
                print(f": {len(result['records'])} steps, {result['process_seconds']:.0f} s, {stopped}", flush=True)
                if not result["records"]:
                    print(f"agentic: no steps; see {run_dir / 'output.log'}", flush=True)
    print(write(data, out))
    print(f"agentic: {out / 'table.md'}, {out / 'plot.png'}, {out / 'runs.json'}")


if __name__ == "__main__":
    main()
