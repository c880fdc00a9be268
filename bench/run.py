"""The benchmark's one entry point: TRL and Molt on the same workloads and seeds, alternating, into one report.

    .venv/bin/python bench/run.py [--workloads small large] [--seeds 0 1] [--steps 300] [--systems trl molt molt-sync]

Runs in Molt's .venv. Each workload's model is built once, with seed 0, into
bench/results/models/<workload>-seed0 and reused by later invocations: every
seed and system starts from the same weights, so a seed changes the prompts,
the sampling and the initial random state, not the starting model. TRL runs
in bench/.venv-trl (bench/setup_trl.sh). The runs alternate, every system in
turn for one seed before the next seed, so a drift in the machine's load falls
on all systems alike.

The systems, on the settings of bench/workload.py:
- trl: bench/trl_run.py, TRL's GRPOTrainer (generate, then train, in one process).
- molt: molt-train, asynchronous (rollouts generated while the trainer steps).
- molt-sync: molt-train --train.async_queue_size 0 (strictly on-policy, as TRL).
- molt-lora: molt, training LoRA adapters (workload.LORA_RANK, alpha twice the rank, workload.LORA_LR)
  instead of the full weights; not in the default systems.

Into bench/results/<timestamp>/: runs/<workload>-<system>-seed<s>/ (each
run's output.log and per-step JSON lines), runs.json (every run's raw
per-step records and process wall clock, rewritten after each run), and
table.md and plot.png (bench/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
TRL_PYTHON = BENCH / ".venv-trl" / "bin" / "python"
MOLT_TRAIN = Path(sys.prefix) / "bin" / "molt-train"

sys.path.insert(0, str(BENCH))
import report  # noqa: E402
import workload  # noqa: E402


def trl_command(model: Path, name: str, seed: int, steps: int, run_dir: Path, max_tokens: int | None = None,
                groups_per_step: int = workload.GROUPS_PER_STEP) -> list[str]:
    return [str(TRL_PYTHON), str(BENCH / "trl_run.py"), "--model", str(model), "--workload", name,
            "--seed", str(seed), "--steps", str(steps), "--out", str(run_dir / "steps.jsonl"),
            "--max-tokens", str(max_tokens or workload.WORKLOADS[name]["max_tokens"]),
            "--groups-per-step", str(groups_per_step)]


def molt_command(model: Path, name: str | None, seed: int, steps: int, run_dir: Path,
                 env: str = "bench/addition.py:Addition", max_tokens: int | None = None,
                 lr: float = workload.LR, groups_per_step: int = workload.GROUPS_PER_STEP) -> list[str]:
    """molt-train on the run's settings (bench/workload.py); `env`, `max_tokens` (default: the workload
    `name`'s), `lr` and `groups_per_step` for the workloads of other scripts (bench/agentic.py,
    bench/scaling.py)."""
    return [str(MOLT_TRAIN), "--env", env, "--model", str(model), "--steps", str(steps),
            "--seed", str(seed), "--out", str(run_dir),
            "--rollout.max_tokens", str(max_tokens or workload.WORKLOADS[name]["max_tokens"]),
            "--rollout.group_size", str(workload.GROUP_SIZE),
            "--rollout.groups_per_step", str(groups_per_step),
            "--rollout.temperature", str(workload.TEMPERATURE),
            "--train.lr", str(lr), "--train.lr_schedule", "constant", "--train.weight_decay", "0",
            "--train.grad_clip", "1.0",
            "--algo.estimator", "grpo", "--algo.kl_coef", "0",
            "--algo.clip_low", str(workload.CLIP), "--algo.clip_high", str(workload.CLIP),
            "--ckpt.every", "0", "--log.tensorboard", "false"]


def molt_sync_command(model: Path, name: str, seed: int, steps: int, run_dir: Path, **settings) -> list[str]:
    return molt_command(model, name, seed, steps, run_dir, **settings) + ["--train.async_queue_size", "0"]


def molt_lora_command(model: Path, name: str, seed: int, steps: int, run_dir: Path) -> list[str]:
    return molt_command(model, name, seed, steps, run_dir) + [
        "--actor.lora.rank", str(workload.LORA_RANK), "--actor.lora.alpha", str(2 * workload.LORA_RANK),
        "--train.lr", str(workload.LORA_LR)]


# system -> (command, the file of its per-step JSON lines in the run directory)
SYSTEMS = {
    "trl": (trl_command, "steps.jsonl"),
    "molt": (molt_command, "metrics.jsonl"),
    "molt-sync": (molt_sync_command, "metrics.jsonl"),
    "molt-lora": (molt_lora_command, "metrics.jsonl"),
}


def model(name: str) -> Path:
    """The workload's model, built once with seed 0 (into a scratch directory first, so a build cut short
    is never taken for a model)."""
    path = RESULTS / "models" / f"{name}-seed0"
    if not (path / "config.json").is_file():
        scratch = path.with_name(path.name + ".partial")
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"bench: building the {name} model into {path}", flush=True)
        workload.build(name, scratch, seed=0)
        scratch.rename(path)
    return path


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []
    return f"{os.cpu_count()} CPUs ({names[0] if names else platform.processor()}), {platform.platform()}"


def run_one(system: str, model_dir: Path, name: str, seed: int, steps: int, run_dir: Path) -> dict:
    """One run, its output in run_dir/output.log; its raw per-step records and process wall clock."""
    command_of, records_file = SYSTEMS[system]
    return {"workload": name, "system": system, "seed": seed,
            **run_command(command_of(model_dir, name, seed, steps, run_dir), run_dir, records_file)}


STOP_GRACE = 60  # seconds a run stopped at its wall cap has to end by itself (Molt saves its last step)


def run_command(command: list[str], run_dir: Path, records_file: str, wall_cap: float | None = None) -> dict:
    """Run `command` in the repository, its output in run_dir/output.log, stopped with SIGTERM after
    `wall_cap` seconds (then killed, with whatever it started, after STOP_GRACE more); the command, its exit
    code, process wall clock, whether the cap stopped it, and the JSON lines of run_dir/records_file."""
    run_dir.mkdir(parents=True)
    started = time.perf_counter()
    capped = False
    with (run_dir / "output.log").open("w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=wall_cap)
        except subprocess.TimeoutExpired:
            capped = True
            process.terminate()
            try:
                returncode = process.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                returncode = process.wait()
    process_seconds = time.perf_counter() - started
    path = run_dir / records_file
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return {"command": command, "returncode": returncode, "process_seconds": process_seconds, "capped": capped,
            "records": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["small", "large"], choices=sorted(workload.WORKLOADS),
                        help="workloads of bench/workload.py, each with its own model")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="seeds, each run by every system")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--systems", nargs="+", default=["trl", "molt", "molt-sync"], choices=list(SYSTEMS),
                        help="systems to run, in this order for each seed")
    args = parser.parse_args()

    out = RESULTS / time.strftime("%Y%m%d-%H%M%S")
    data = {"machine": machine(), "steps": args.steps, "workloads": args.workloads, "seeds": args.seeds,
            "systems": args.systems, "runs": []}
    if "trl" in args.systems and subprocess.run(["bash", str(BENCH / "setup_trl.sh")]).returncode != 0:
        sys.exit("bench: bench/setup_trl.sh failed (see above)")
    total = len(args.workloads) * len(args.seeds) * len(args.systems)
    for name in args.workloads:
        model_dir = model(name)
        for seed in args.seeds:
            for system in args.systems:
                run_dir = out / "runs" / f"{name}-{system}-seed{seed}"
                print(f"bench: [{len(data['runs']) + 1}/{total}] {name} {system} seed {seed}", end="", flush=True)
                run = run_one(system, model_dir, name, seed, args.steps, run_dir)
                data["runs"].append(run)
                (out / "runs.json").write_text(json.dumps(data, indent=1))
                print(f": {run['process_seconds']:.0f} s", flush=True)
                if run["returncode"] != 0 or len(run["records"]) != args.steps:
                    sys.exit(f"bench: {name} {system} seed {seed} exited with {run['returncode']} after "
                             f"{len(run['records'])} of {args.steps} steps; see {run_dir / 'output.log'}")
    print(report.write(data, out))
    print(f"bench: {out / 'table.md'}, {out / 'plot.png'}, {out / 'runs.json'}")


if __name__ == "__main__":
    main()
