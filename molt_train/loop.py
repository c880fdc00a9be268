"""The one asynchronous loop: rollouts in, optimizer steps out, weights back to the engines.

    for each step:
        groups   <- the rollout workers (generated ahead when async; when synchronous, started at the weight
                    sync of the step before and sampled by its weights)
        batch    <- validate, staleness, advantages, dynamic filtering
        stats    <- the trainer: old logprobs, IS-correct, loss, backward, optimizer step
        weights  -> the engines (pause, load, version + 1, resume)
        eval     <- held-out episodes on the engines, when due (`evaluate`; never trained on)
        metrics, saved rollouts (`--log.rollouts`), checkpoint

Every step logs where its time went, as `time/*` seconds: `wait` (for the
rollouts), `assemble`, `train` (= `pack` on the driver + `ray`, transfers and
scheduling, + `rank_step`, the slowest rank's step: `logprobs`, a separate
old-logprob forward, 0 when the training forward gives them, +
`forward_backward` + `optimizer`), `sync`, `eval` (at steps that evaluate), `step` (all of it) and `elapsed`
(since the loop began); `generate` is a group's mean time from its start to its
end (groups overlap each other, and training in async mode; in synchronous
mode they start at the weight sync of the step before and wait for its
weights).

Infrastructure (Ray actors, ports, placement) lives in `runtime`; this file
is the loop and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from molt_train import checkpoint
from molt_train.console import Console
from molt_train.evaluate import Evaluator
from molt_train.group import Group
from molt_train.metrics import Metrics, plot
from molt_train.runtime import Runtime
from molt_train.saved_rollouts import RolloutLog
from molt_train.stop import StopSignals, Stopped

if TYPE_CHECKING:
    from molt_train.actor.policy import StepStats


async def train(config, run_dir: Path, model_dir: str, console: Console) -> None:
    resume_from = checkpoint.latest(run_dir) if config.resume else None
    state = checkpoint.load_state(resume_from) if resume_from else {
        "step": 0, "version": 0, "data": {"next_index": 0, "redo": []}}
    if resume_from:
        console.phase(f"resuming from {resume_from}")
    runtime = await Runtime.start(config, model_dir, resume_from, state, console)
    # Not imported at the top: the driver imports torch (here, and the trainer's modules) only once its rollout
    # workers are starting, so that torch's import overlaps their start (`Runtime.start`).
    from molt_train.batch import assemble

    metrics = Metrics(run_dir, config, resume_step=state["step"])
    rollouts = RolloutLog(run_dir, config.log, resume_step=state["step"]) if config.log.rollouts else None
    step, version = state["step"], state["version"]
    progress = console.progress(config.steps, step)
    evaluator = Evaluator(config, runtime.workers, recover=runtime.check_workers)
    stop = StopSignals().install()
    saved = step  # the last step with a checkpoint

    async def save() -> Path:
        nonlocal saved
        state = {"step": step, "version": version, "data": runtime.groups.position(), "seed": config.seed}
        saved = step
        return await checkpoint.save(runtime.trainer, run_dir, model_dir, state, config.ckpt.keep)

    try:
        if step == 0 and evaluator.due(0):  # the initial policy, as step 0
            metrics.log(0, await evaluator.run())
            if rollouts:
                rollouts.write(0, [], evaluator.plays)
            progress.set_postfix(eval=f"{evaluator.last_reward:.3f}")
            console.startup.mark("first_eval")
        reported: set[str] = set()  # failure messages already shown
        failing: list[str] = []  # the first failure of each step in a row whose every episode failed
        began = time.perf_counter()
        first = True  # this process's first step: it logs `time/startup/*`
        prefetch = _prefetches(config)
        while step < config.steps and stop.received is None:
            started = time.perf_counter()
            groups = await stop.unless_stopped(runtime.groups.take())
            if groups is None:
                break
            waited = time.perf_counter() - started
            if first:
                console.startup.mark("first_rollouts")

            items, stats = assemble(groups, version, config.algo)
            segments = {}  # for the saved rollouts: what the trainer did with each segment
            assembled = time.perf_counter() - started - waited
            failures = [failure for group in groups for failure in group.failures]
            if failures and failures[0].splitlines()[0] not in reported:
                reported.add(failures[0].splitlines()[0])
                progress.write(f"molt-train: step {step + 1}: an episode failed and was dropped:\n{failures[0]}",
                               file=console.terminal)
            failing = failing + failures[:1] if failures and not any(g.trajectories for g in groups) else []
            if config.rollout.max_failed_steps and len(failing) >= config.rollout.max_failed_steps:
                first = step + 2 - len(failing)
                raise RunFailed(f"every episode of the last {len(failing)} steps failed (steps {first}-{step + 1}); "
                                f"the first: {failing[0].splitlines()[0]}")
            stepped = time.perf_counter()
            if config.actor.colocate:  # the engines' GPU memory goes to the trainer for the step
                await runtime.sleep_engines()
            if items:
                stats |= _train_stats(await runtime.train_step(items))
                if rollouts:
                    segments = {item.key: {"trained": True, "advantage": item.advantage, "trainer_logprobs": logprobs}
                               for item, logprobs in zip(items, await runtime.trainer.trained_logprobs(items))}
            else:  # every group filtered or dropped: nothing to learn from this step
                stats |= dict.fromkeys(TRAIN_KEYS)
            if config.actor.colocate:
                await runtime.wake_engines()
            trained = time.perf_counter() - stepped
            if first:
                console.startup.mark("first_step")
                stats |= console.startup.metrics()
                first = False

            syncing = time.perf_counter()
            if items and prefetch and step + 1 < config.steps:  # the step syncs its weights: version + 1
                runtime.groups.prefetch(version + 1)
            if items:
                version = await runtime.sync_weights()
            synced = time.perf_counter() - syncing

            step += 1
            evaluated = evaluator.due(step)
            if evaluated:  # the weights just synced, before the next step's sync
                stats |= await evaluator.run()
            ended = time.perf_counter()
            stats |= {"version": version, "time/wait": waited, "time/assemble": assembled,
                      "time/generate": sum(g.seconds for g in groups) / len(groups), "time/train": trained,
                      "time/ray": None if stats["time/rank_step"] is None else
                      max(trained - stats["time/rank_step"] - stats["time/pack"], 0.0),
                      "time/sync": synced, "sync/bytes": runtime.sync_bytes if items else 0,
                      "time/step": ended - started, "time/elapsed": ended - began,
                      "rollouts/lost_groups": runtime.groups.take_lost(),
                      **_replaced_stats(runtime.groups.take_replaced(), groups),
                      "throughput/tokens_per_s": stats["tokens/trained"] / max(ended - started, 1e-9)}
            metrics.log(step, stats)
            metrics.episodes(step, groups)
            if rollouts:
                rollouts.write(step, groups, evaluator.plays if evaluated else None, segments)
            progress.update(1)
            shown = {} if evaluator.last_reward is None else {"eval": f"{evaluator.last_reward:.3f}"}
            progress.set_postfix(reward=f"{stats['reward/mean']:.3f}", **shown, refresh=False)
            if config.log.plot_every and step % config.log.plot_every == 0:
                plot(run_dir)
            if step == config.steps or (config.ckpt.every and step % config.ckpt.every == 0):
                await save()
        if stop.received is not None:
            kept = await save() if step != saved else checkpoint.latest(run_dir)
            raise Stopped(stop.received, f"stopped by {stop.received.name} after step {step}; "
                                         f"{'checkpoint ' + str(kept) if kept else 'no step to save'}")
    except Exception as error:
        if stop.received is None or isinstance(error, Stopped):
            raise
        # The signal reached the run's other processes too (sent to a process group, as `timeout` and a
        # terminal's Ctrl-C do) and one of them ended in the middle of a step: resume from the last save.
        kept = checkpoint.latest(run_dir)
        raise Stopped(stop.received, f"stopped by {stop.received.name} during step {step + 1}, which a process "
                                     f"of the run did not finish ({type(error).__name__}); "
                                     f"{'checkpoint ' + str(kept) if kept else 'no step saved'}") from error
    finally:
        stop.remove()
        progress.close()
        metrics.close()
        await runtime.close()
    console.say(f"plots: {plot(run_dir)}")


def _prefetches(config) -> bool:
    """Whether a synchronous run starts the next step's groups as it syncs the weights (`GroupStream.prefetch`).
    Not where a weight update waits for the episodes in flight (no partial rollout: they would wait for it), or
    under LoRA, whose engine binds a request to the adapter it serves when the request starts (before the first
    weight sync, none)."""
    return config.train.async_queue_size == 0 and config.rollout.partial_rollout and not config.actor.lora.rank


def _replaced_stats(replaced: list[Group], trained: list[Group]) -> dict:
    """Dynamic sampling's groups set aside this step, and the mean reward of every episode the step played
    (`reward/mean` is of the groups it trained, which dynamic sampling picks for their mixed rewards)."""
    rewards = [reward for group in replaced + trained for reward in group.rewards()]
    return {"rollouts/replaced_groups": len(replaced),
            "reward/played_mean": float(np.mean(rewards)) if rewards else 0.0}


class RunFailed(RuntimeError):
    """The run cannot train: every episode of several steps in a row failed."""


TRAIN_KEYS = ("loss", "clip_frac", "entropy", "kl", "grad_norm", "mismatch/kl", "mismatch/max_abs",
              "mismatch/tokens", "offpolicy/kl", "offpolicy/tokens", "is/filtered_frac", "time/pack", "time/logprobs",
              "time/forward_backward", "time/optimizer", "time/rank_step")


def _train_stats(stats: StepStats) -> dict:
    """The trainer's statistics as metrics, per token; None where nothing was measured."""
    def per(total, count):
        return total / count if total is not None and count else None

    routing = {}
    if stats.routing_compared:  # MoE with engine routes: how often the trainer's own top-k agrees
        routing["routing/agreement"] = stats.routing_hits / stats.routing_compared
    return routing | {
        "loss": stats.loss_sum / stats.tokens,
        "clip_frac": stats.clipped_tokens / stats.tokens,
        "entropy": per(stats.entropy_sum, stats.tokens),
        "kl": per(stats.kl_sum, stats.tokens),
        "grad_norm": stats.grad_norm,
        # Tokens sampled by the weights the trainer holds: ~0 unless the engine or the weight sync is broken.
        "mismatch/kl": per(stats.mismatch_kl_sum, stats.mismatch_tokens),
        "mismatch/max_abs": stats.mismatch_max_abs,
        "mismatch/tokens": stats.mismatch_tokens,
        # Tokens sampled by older weights: how far the policy moved since.
        "offpolicy/kl": per(stats.offpolicy_kl_sum, stats.offpolicy_tokens),
        "offpolicy/tokens": stats.offpolicy_tokens,
        "is/filtered_frac": 1.0 - stats.kept_tokens / stats.tokens,
        # Where the trainer's time went (time/ray, in the loop, is the rest of time/train: transfers, scheduling).
        "time/pack": stats.seconds_pack, "time/logprobs": stats.seconds_logprobs,
        "time/forward_backward": stats.seconds_forward_backward, "time/optimizer": stats.seconds_optimizer,
        "time/rank_step": stats.seconds_step,
    }


def run(config, run_dir: Path, model_dir: str, console: Console) -> None:
    asyncio.run(train(config, run_dir, model_dir, console))
