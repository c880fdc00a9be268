"""How cost grows: seconds per step of TRL and Molt as the step grows, and each system's peak memory.

    .venv/bin/python bench/scaling.py [--groups 8 16 32 64] [--reply-tokens 3 16 64] [--memory-workloads small]
                                      [--systems trl molt molt-sync] [--seeds 0] [--steps 20]
                                      [--cpu-lock /tmp/molt-cpu.lock]

Runs in Molt's .venv, the runs of bench/run.py (same systems, commands and
settings) on the large workload's model, in two sweeps from its default of
16 groups of 8 and 16 reply tokens: groups per step (--groups, replies at
most 16 tokens) and the most tokens a reply may take (--reply-tokens, 16
groups); and, for the peak memory of each system at the default settings,
the same runs on --memory-workloads (the large workload's default is in its
sweeps). Every system runs each setting in turn before the next setting, so a
drift in the machine's load falls on all of them alike (`settings` gives the
order).

Each run samples its whole process tree every SAMPLE_SECONDS (this script's
descendants: TRL's one process; Molt's driver, Ray's services and workers,
the trainer rank and the rollout worker): the peak of the tree's summed RSS,
and each kind of process's own peak (`role`). s/step and the breakdown
(bench/report.py's rollout, train and sync) are medians after the first
--warmup steps.

Into bench/results/scaling-<timestamp>/: runs/<workload>-g<groups>-t<tokens>-<system>-seed<s>/,
runs.json (rewritten after each run) and table.md (rewritten after each run,
marked partial until the last).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import report  # noqa: E402
import run  # noqa: E402
import workload  # noqa: E402
import agentic  # noqa: E402

SAMPLE_SECONDS = 0.2
MIB = 2**20


# --------------------------------------------------------------------------
# Memory of a run's process tree


def role(process: psutil.Process, drivers: set[int]) -> str:
    """What a process of the run is: the driver (a command this script started, `drivers`), a Ray worker by its
    title (ray::<actor class>.<method> -> the class; ray::IDLE for a pooled worker), else its program or
    Python script (raylet, gcs_server, dashboard.py, ...)."""
    if process.pid in drivers:
        return "driver"
    command = process.cmdline() or [process.name()]
    head = command[0].split()[0]
    if head.startswith("ray::"):
        return head.removeprefix("ray::").split(".")[0]
    return next((Path(arg).name for arg in command[1:] if arg.endswith(".py")), Path(head).name)


class TreeMemory:
    """In a thread, every SAMPLE_SECONDS: the RSS of every descendant of this process, summed over the tree
    and over each role. Keeps the tree's peak (and how many processes it had then) and each role's peak."""

    def __init__(self):
        self.peak = 0
        self.processes_at_peak = 0
        self.role_peaks: dict[str, int] = defaultdict(int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(SAMPLE_SECONDS):
            drivers = {child.pid for child in me.children()}
            by_role: dict[str, int] = defaultdict(int)
            for process in me.children(recursive=True):
                try:
                    by_role[role(process, drivers)] += process.memory_info().rss
                except psutil.Error:  # ended between the listing and the reading
                    continue
            total = sum(by_role.values())
            if total > self.peak:
                self.peak, self.processes_at_peak = total, len(me.children(recursive=True))
            for name, rss in by_role.items():
                self.role_peaks[name] = max(self.role_peaks[name], rss)

    def result(self) -> dict:
        return {"peak_bytes": self.peak, "processes_at_peak": self.processes_at_peak,
                "role_peak_bytes": dict(sorted(self.role_peaks.items(), key=lambda item: -item[1]))}


# --------------------------------------------------------------------------
# The report


def reply_tokens(run_data: dict, warmup: int) -> float | None:
    """The replies' mean length in tokens over the steps after `warmup`."""
    key = "reply_tokens" if run_data["system"] == "trl" else "response_len/mean"
    return report._mean(r.get(key) for r in run_data["records"][warmup:])


def _runs(data: dict, setting: tuple, system: str) -> list[dict]:
    """The runs of `system` at `setting` (workload, groups per step, reply tokens at most) that did steps."""
    return [r for r in data["runs"] if r["records"] and r["system"] == system
            and (r["workload"], r["groups_per_step"], r["max_tokens"]) == tuple(setting)]


def _cell(values: list, fmt) -> str:
    """The mean over seeds, then each seed's value (bench/agentic.py's cell), or the one seed's value."""
    return agentic._cell(values, fmt) if len(values) > 1 else "-" if values[0] is None else fmt(values[0])


def _mib(values: list) -> str:
    return _cell([None if v is None else v / MIB for v in values], lambda x: f"{x:.0f}")


def _roles(runs: list[dict]) -> str:
    """Each role's peak in MiB (mean over seeds), largest first."""
    names = list(dict.fromkeys(name for r in runs for name in r["memory"]["role_peak_bytes"]))
    peaks = {name: report._mean(r["memory"]["role_peak_bytes"].get(name) for r in runs) for name in names}
    return ", ".join(f"{name} {peak / MIB:.0f}" for name, peak in sorted(peaks.items(), key=lambda item: -item[1]))


def _sweep(data: dict, settings: list[tuple], title: str) -> list[str]:
    header = ["groups x 8", "reply tokens (at most)", "system", "s/step", "s/step / TRL's", "rollout s/step",
              "train s/step", "sync s/step", "reply tokens (mean)", "peak RSS of the tree (MiB)"]
    lines = [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, groups, tokens in settings:
        trl_step = None
        for system in data["systems"]:
            runs = _runs(data, (name, groups, tokens), system)
            if not runs:
                continue
            summaries = [report.summary(r, data["warmup"]) for r in runs]
            step = report._mean(s["s_per_step"] for s in summaries)
            trl_step = step if system == "trl" else trl_step
            lines.append("| " + " | ".join([
                str(groups), str(tokens), system, _cell([s["s_per_step"] for s in summaries], report._seconds),
                "-" if system == "trl" else report._ratio(step, trl_step),
                *(report._seconds(report._mean(s[key] for s in summaries)) for key in ("rollout", "train", "sync")),
                _cell([reply_tokens(r, data["warmup"]) for r in runs], lambda x: f"{x:.1f}"),
                _mib([r["memory"]["peak_bytes"] for r in runs])]) + " |")
    return lines + [""]


def table(data: dict) -> str:
    done, total = len(data["runs"]), data["total_runs"]
    large_tokens = workload.WORKLOADS["large"]["max_tokens"]
    groups_sweep = sorted(s for s in data["settings"] if s[0] == "large" and s[2] == large_tokens)
    tokens_sweep = sorted(s for s in data["settings"] if s[0] == "large" and s[1] == workload.GROUPS_PER_STEP)
    defaults = [(name, workload.GROUPS_PER_STEP, workload.WORKLOADS[name]["max_tokens"])
                for name in dict.fromkeys(s[0] for s in data["settings"])]
    lines = [f"# How cost grows: Molt and TRL, {data['steps']} steps a run, seeds "
             f"{', '.join(map(str, data['seeds']))}" + ("" if done == total else f" (partial: {done} of {total} runs)"),
             "", f"Machine: {data['machine']}.", "",
             f"The large workload's model. s/step, rollout, train, sync: medians after the first {data['warmup']} "
             "steps (rollout: TRL's generate-and-score; Molt's wait for rollouts, time/wait). Reply tokens: the "
             "replies' mean length. Peak RSS of the tree: the largest sum, sampled every "
             f"{SAMPLE_SECONDS} s, of the RSS of every process of the run (Molt: driver, Ray's services and workers, "
             "trainer rank, rollout worker; TRL: its one process); a page shared by several processes (libraries, "
             "torch's code) counts once per process, so the sum overstates what the tree holds. Each cell: the mean "
             "over seeds, then per seed.", ""]
    lines += _sweep(data, groups_sweep, "Groups per step (replies of at most 16 tokens)")
    lines += _sweep(data, tokens_sweep, f"Reply length ({workload.GROUPS_PER_STEP} groups of 8 a step)")
    header = ["workload", "system", "peak RSS of the tree (MiB)", "processes", "each kind of process's own peak (MiB)"]
    lines += [f"## Peak memory ({workload.GROUPS_PER_STEP} groups of 8, the workload's reply length)", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, groups, tokens in defaults:
        for system in data["systems"]:
            runs = _runs(data, (name, groups, tokens), system)
            if runs:
                lines.append("| " + " | ".join([
                    name, system, _mib([r["memory"]["peak_bytes"] for r in runs]),
                    _cell([r["memory"]["processes_at_peak"] for r in runs], lambda x: f"{x:.0f}"),
                    _roles(runs)]) + " |")
    failed = [r for r in data["runs"] if r["returncode"] != 0 or len(r["records"]) != data["steps"]]
    lines += [""] + [f"Failed: {r['workload']} {r['groups_per_step']}x8 {r['max_tokens']} tokens {r['system']} seed "
                     f"{r['seed']}: exit {r['returncode']} after {len(r['records'])} steps" for r in failed]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# The runs


def settings(groups: list[int], reply_tokens: list[int], memory_workloads: list[str]) -> list[tuple[str, int, int]]:
    """(workload, groups per step, reply tokens at most) of every setting, each once, in the order they run:
    the defaults first (the large workload's, then the other workloads'), then the sweeps' other settings on
    the large workload, the most tokens a step first, so that a matrix cut short still has each sweep's ends."""
    large_tokens = workload.WORKLOADS["large"]["max_tokens"]
    defaults = [(name, workload.GROUPS_PER_STEP, workload.WORKLOADS[name]["max_tokens"])
                for name in ["large", *memory_workloads]]
    sweeps = [("large", g, large_tokens) for g in groups]
    sweeps += [("large", workload.GROUPS_PER_STEP, t) for t in reply_tokens]
    return list(dict.fromkeys(defaults + sorted(sweeps, key=lambda s: -s[1] * s[2])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--groups", nargs="*", type=int, default=[8, 16, 32, 64],
                        help="groups per step of the first sweep (replies of the large workload's length)")
    parser.add_argument("--reply-tokens", nargs="*", type=int, default=[3, 16, 64],
                        help="the most tokens a reply may take, second sweep (the default groups per step)")
    parser.add_argument("--memory-workloads", nargs="*", default=["small"], choices=sorted(workload.WORKLOADS),
                        help="workloads also run at their default settings, for their peak memory")
    parser.add_argument("--systems", nargs="+", default=["trl", "molt", "molt-sync"],
                        choices=["trl", "molt", "molt-sync"], help="systems, in this order for each setting")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds, each run on every setting")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--wall-cap", type=float, default=900, help="seconds a run's process may take, at most")
    parser.add_argument("--cpu-lock", default=None, help="a lock file (flock) to hold during each run")
    args = parser.parse_args()

    runs_of = settings(args.groups, args.reply_tokens, args.memory_workloads)
    with agentic.cpu_lock(args.cpu_lock):
        models = {name: run.model(name) for name in dict.fromkeys(s[0] for s in runs_of)}
    if "trl" in args.systems and subprocess.run(["bash", str(BENCH / "setup_trl.sh")]).returncode != 0:
        sys.exit("scaling: bench/setup_trl.sh failed (see above)")
    out = run.RESULTS / time.strftime("scaling-%Y%m%d-%H%M%S")
    data = {"machine": run.machine(), "steps": args.steps, "warmup": args.warmup, "seeds": args.seeds,
            "systems": args.systems, "settings": runs_of,
            "total_runs": len(args.seeds) * len(runs_of) * len(args.systems), "runs": []}
    for seed in args.seeds:
        for name, groups, tokens in runs_of:
            for system in args.systems:
                command_of, records_file = run.SYSTEMS[system]
                run_dir = out / "runs" / f"{name}-g{groups}-t{tokens}-{system}-seed{seed}"
                print(f"scaling: [{len(data['runs']) + 1}/{data['total_runs']}] {name} {groups}x8 {tokens} tokens "
                      f"{system} seed {seed}", end="", flush=True)
                command = command_of(models[name], name, seed, args.steps, run_dir, max_tokens=tokens,
                                     groups_per_step=groups)
                with agentic.cpu_lock(args.cpu_lock), TreeMemory() as memory:
                    result = run.run_command(command, run_dir, records_file, wall_cap=args.wall_cap)
                data["runs"].append({"workload": name, "groups_per_step": groups, "max_tokens": tokens,
                                     "system": system, "seed": seed, **result, "memory": memory.result()})
                (out / "runs.json").write_text(json.dumps(data, indent=1))
                (out / "table.md").write_text(table(data))
                print(f": {len(result['records'])} steps, {result['process_seconds']:.0f} s, exit "
                      f"{result['returncode']}, peak {memory.peak / MIB:.0f} MiB", flush=True)
    print(table(data))
    print(f"scaling: {out / 'table.md'}, {out / 'runs.json'}")


if __name__ == "__main__":
    main()
