"""The one asynchronous loop: rollouts in, optimizer steps out, weights back to the engines.

    for each step:
        groups   <- the rollout workers (generated ahead when async)
        batch    <- validate, staleness, advantages, dynamic filtering
        stats    <- the trainer: recompute logprobs, IS-correct, loss, backward, optimizer step
        weights  -> the engines (pause, load, version + 1, resume)
        metrics, checkpoint

Infrastructure (Ray actors, ports, placement) lives in `runtime`; this file
is the loop and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from molt_train import checkpoint
from molt_train.batch import assemble
from molt_train.metrics import Metrics, plot
from molt_train.runtime import Runtime


async def train(config, run_dir: Path, model_dir: str) -> None:
    resume_from = checkpoint.latest(run_dir) if config.resume else None
    state = checkpoint.load_state(resume_from) if resume_from else {
        "step": 0, "version": 0, "data": {"next_index": 0, "redo": []}}
    runtime = await Runtime.start(config, model_dir, resume_from, state)
    metrics = Metrics(run_dir, config, resume_step=state["step"])
    step, version = state["step"], state["version"]
    try:
        progress = _progress_bar(config.steps, step)
        reported: set[str] = set()  # failure messages already shown
        while step < config.steps:
            started = time.perf_counter()
            groups = await runtime.groups.take()
            waited = time.perf_counter() - started

            items, stats = assemble(groups, version, config.algo)
            example = stats.pop("episodes/failure_example", None)
            if example and example.splitlines()[0] not in reported:
                reported.add(example.splitlines()[0])
                progress.write(f"molt-train: step {step + 1}: an episode failed and was dropped:\n{example}")
            started = time.perf_counter()
            if items:
                stats |= _train_stats(await runtime.trainer.step(items))
            else:  # every group filtered or dropped: nothing to learn from this step
                stats |= dict.fromkeys(TRAIN_KEYS)
            trained = time.perf_counter() - started

            started = time.perf_counter()
            if items:
                version = await runtime.sync_weights()
            synced = time.perf_counter() - started

            step += 1
            stats |= {"version": version, "time/wait": waited,
                      "time/generate": sum(g["seconds"] for g in groups) / len(groups), "time/train": trained,
                      "time/sync": synced,
                      "throughput/tokens_per_s": stats["tokens/trained"] / max(waited + trained + synced, 1e-9)}
            metrics.log(step, stats)
            progress.update(1)
            progress.set_postfix(reward=f"{stats['reward/mean']:.3f}", refresh=False)
            if config.log.plot_every and step % config.log.plot_every == 0:
                plot(run_dir)
            if step == config.steps or (config.ckpt.every and step % config.ckpt.every == 0):
                state = {"step": step, "version": version, "data": runtime.groups.position(), "seed": config.seed}
                await checkpoint.save(runtime.trainer, run_dir, model_dir, state, config.ckpt.keep)
        progress.close()
    finally:
        metrics.close()
        await runtime.close()
    print(f"plots: {plot(run_dir)}")


TRAIN_KEYS = ("loss", "clip_frac", "entropy", "kl", "grad_norm", "mismatch/kl", "mismatch/max_abs",
              "is/filtered_frac")


def _train_stats(result: dict) -> dict:
    tokens = max(result["tokens"], 1)
    routing = {}
    if result.get("routing_compared"):  # MoE with engine routes: how often the trainer's own top-k agrees
        routing["routing/agreement"] = result["routing_hits"] / result["routing_compared"]
    return routing | {
        "loss": result["loss"] / tokens,
        "clip_frac": result["clip_frac"] / tokens,
        "entropy": result["entropy"] / tokens,
        "kl": result["kl"] / tokens,
        "grad_norm": result["grad_norm"],
        "mismatch/kl": result["mismatch_kl_sum"] / tokens,
        "mismatch/max_abs": result["mismatch_max"],
        "is/filtered_frac": 1.0 - result["is_kept"] / tokens,
    }


def _progress_bar(total: int, done: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="molt-train", unit="step", dynamic_ncols=True)


def run(config, run_dir: Path, model_dir: str) -> None:
    asyncio.run(train(config, run_dir, model_dir))
