"""A real-size policy through the whole loop on this CPU: where the time and the memory go, against the plan.

    .venv/bin/python bench/real_size.py [--like recipes/models/qwen3-0.6b] [--steps 3] [--only NAME ...]

Builds (once, cached) a randomly initialised model of the exact shape of
`--like`'s config.json (`molt-tiny --like`: Qwen3-0.6B's 28 layers, 151,936
tokens, tied embeddings) and runs `molt-train` on the default task for
`--steps` steps with a small batch (2 groups x 4 samples, 16 new tokens, no
reference model), once per setting: fp32, and bf16 mixed precision with full
activation checkpointing and chunked logprobs; each synchronous and
asynchronous. While a run goes, the peak resident memory (the kernel's
VmHWM) of its trainer rank and of its rollout worker (the vLLM engine runs in
it) is sampled from /proc; the plan's estimate for the same flags comes from
`molt-train --dry-run` on this machine. Prints a markdown table: seconds per
phase (mean over the steps after the first), trained tokens per second,
the weight sync's bytes and seconds, and each peak beside its estimate.
Each run's checkpoints are deleted as it ends (its metrics stay).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

BATCH = ["--rollout.groups_per_step", "2", "--rollout.group_size", "4", "--rollout.max_tokens", "16",
         "--rollout.max_total_tokens", "128", "--train.micro_batch_tokens", "256", "--algo.kl_coef", "0",
         "--engine.max_model_len", "512", "--log.tensorboard", "false"]
SETTINGS = {
    "fp32 sync": ["--train.async_queue_size", "0"],
    "fp32 async": ["--train.async_queue_size", "2"],
    "bf16+ckpt sync": ["--train.async_queue_size", "0", "--actor.param_dtype", "bfloat16",
                       "--actor.activation_checkpointing", "full", "--actor.logprob_chunk_tokens", "64"],
    "bf16+ckpt async": ["--train.async_queue_size", "2", "--actor.param_dtype", "bfloat16",
                        "--actor.activation_checkpointing", "full", "--actor.logprob_chunk_tokens", "64"],
}
PHASES = ["time/step", "time/generate", "time/train", "time/logprobs", "time/forward_backward", "time/optimizer",
          "time/sync"]
ROLES = {"trainer": "PolicyRank", "engine": "RolloutWorker"}  # Ray's process titles: ray::<actor class>


class PeakMemory:
    """The peak resident memory of the trainer and engine processes under a process, sampled as it runs."""

    def __init__(self, root_pid: int, every: float = 0.5):
        self.root, self.every, self.peaks = root_pid, every, dict.fromkeys(ROLES, 0)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                processes = psutil.Process(self.root).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for process in processes:
                try:
                    title = " ".join(process.cmdline())
                    peak = _vm_hwm(process.pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
                    continue
                for role, name in ROLES.items():
                    if f"ray::{name}" in title:
                        self.peaks[role] = max(self.peaks[role], peak)

    def stop(self) -> dict[str, float]:
        self.stopped.set()
        self.thread.join()
        return {role: peak / 1e9 for role, peak in self.peaks.items()}


def _vm_hwm(pid: int) -> int:
    """The process's peak resident set, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def planned(model: Path, flags: list[str]) -> dict[str, float]:
    """The dry run's total for a trainer rank and for an engine, in GB."""
    done = subprocess.run([sys.executable, "-m", "molt_train.cli", "--model", str(model), *flags, "--dry-run"],
                          capture_output=True, text=True, timeout=300)
    totals = [float(m) for m in re.findall(r"^  total\s+([\d.]+) GB", done.stdout, flags=re.M)]
    if len(totals) < 2:
        raise RuntimeError(f"no trainer and engine totals in the dry run:\n{done.stdout}\n{done.stderr[-2000:]}")
    return {"trainer": totals[0], "engine": totals[1]}


def run(model: Path, name: str, flags: list[str], steps: int, out: Path) -> dict:
    """One `molt-train` run; its per-phase means, throughput, sync and measured peaks."""
    run_dir = out / name.replace(" ", "-").replace("+", "-")
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "molt_train.cli", "--model", str(model), "--steps",
                                str(steps), "--out", str(run_dir), *flags],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    memory = PeakMemory(process.pid)
    _, stderr = process.communicate()
    peaks = memory.stop()
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 7 GB a run at 0.6B in fp32 with AdamW's states
    if process.returncode:
        raise RuntimeError(f"{name}: molt-train failed (peaks so far, GB: {peaks}; its log: {run_dir}/molt.log):\n"
                           f"{stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    later = rows[1:] or rows
    means = {key: statistics.mean(r[key] for r in later if r.get(key) is not None)
             for key in PHASES + ["throughput/tokens_per_s", "sync/bytes", "tokens/trained"]
             if any(r.get(key) is not None for r in later)}
    return {"name": name, "wall": time.perf_counter() - started, "means": means, "peaks": peaks,
            "reward": [r["reward/mean"] for r in rows]}


def table(results: list[dict], plans: dict[str, dict]) -> str:
    head = ("| setting | step | generate | train | (logprobs | fwd+bwd | optimizer) | sync | tokens/s | sync GB "
            "| trainer peak GB (plan) | engine peak GB (plan) | run wall |")
    lines = [head, "|" + "---|" * 13]
    for result in results:
        m, peaks, plan = result["means"], result["peaks"], plans[result["name"]]

        def seconds(key):
            return f"{m[key]:.1f}" if key in m else "-"

        def against(role):
            off = (peaks[role] - plan[role]) / plan[role] if plan[role] else float("nan")
            return f"{peaks[role]:.2f} ({plan[role]:.2f}, {off:+.0%})"

        lines.append(f"| {result['name']} | {seconds('time/step')} | {seconds('time/generate')} | "
                     f"{seconds('time/train')} | {seconds('time/logprobs')} | {seconds('time/forward_backward')} | "
                     f"{seconds('time/optimizer')} | {seconds('time/sync')} | "
                     f"{m.get('throughput/tokens_per_s', 0):.1f} | {m.get('sync/bytes', 0) / 1e9:.2f} | "
                     f"{against('trainer')} | {against('engine')} | {result['wall']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", type=Path, default=ROOT / "recipes" / "models" / "qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(SETTINGS), help="run only these settings")
    parser.add_argument("--out", type=Path, default=None, help="run directories (default: a temporary one)")
    args = parser.parse_args()
    from molt_agents.tiny.build import shaped_model

    model = shaped_model(args.like)
    out = args.out or Path(tempfile.mkdtemp(prefix="molt-real-size-"))
    results, plans = [], {}
    for name in args.only or SETTINGS:
        flags = BATCH + SETTINGS[name]
        plans[name] = planned(model, flags)
        results.append(run(model, name, flags, args.steps, out))
        print(f"{name}: {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    print(f"\n{args.like.name}-shaped model ({model}), {args.steps} steps of 2 groups x 4 samples, 16 new tokens; "
          f"seconds are means over the steps after the first\n")
    print(table(results, plans))


if __name__ == "__main__":
    main()
