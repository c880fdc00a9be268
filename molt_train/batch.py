"""From finished groups to the trainer's batch: validation, reward shaping, advantages, staleness, filtering.

Pure bookkeeping over trajectory records; the math lives in `algorithms/`.
A rollout (all its segments) is one sample for the group baseline; its
advantage is broadcast to the trainable tokens of every segment. Every
trained token keeps its age (policy versions since the weights that sampled
it), so the trainer can tell the engine's mismatch (age 0) from staleness.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import torch

from molt_env.trajectory import Trajectory, validate
from molt_train.algorithms.advantages import ESTIMATORS, zero_variance_groups
from molt_train.algorithms.off_policy import stale_tokens
from molt_train.algorithms.overlong import overlong_penalty
from molt_train.config import AlgoConfig
from molt_train.group import Group
from molt_train.packing import TrainItem

Rollout = list[Trajectory]  # the segments of one episode; they share its reward


def assemble(groups: list[Group], version: int, algo: AlgoConfig) -> tuple[list[TrainItem], dict]:
    """The items to train on and the batch's metrics; `version` is the policy version the trainer holds."""
    trajectories, stats = _valid_trajectories(groups)
    rollouts = _rollouts(trajectories)
    stats |= _rollout_stats(rollouts) | env_stats(rollouts) | _age_stats(trajectories, version)
    advantages, informative, filter_stats = _advantages(rollouts, algo)
    bounded, staleness_stats = _bound_staleness(rollouts, version, algo)
    kept = [(rollout, advantage) for rollout, advantage, keep in zip(bounded, advantages, informative)
            if keep and rollout is not None]
    items = [item for rollout, advantage in kept for item in _train_items(rollout, advantage, version)]
    return items, stats | filter_stats | staleness_stats | _trained_stats(items, len(kept), groups)


def _valid_trajectories(groups: list[Group]) -> tuple[list[Trajectory], dict]:
    """The trajectories the validator accepts; counts of failed episodes and of rejected trajectories by reason."""
    trajectories, invalid = [], Counter()
    for group in groups:
        for trajectory in group.trajectories:
            reason = validate(trajectory)
            if reason:
                invalid[reason] += 1
            else:
                trajectories.append(trajectory)
    failures = [failure for group in groups for failure in group.failures]
    stats = {"episodes/failed": len(failures)}
    for reason, count in Counter(failure.split(":", 1)[0] for failure in failures).items():
        stats[f"episodes/failed/{reason}"] = count
    return trajectories, stats | {f"invalid/{reason}": count for reason, count in invalid.items()}


def _rollouts(trajectories: list[Trajectory]) -> list[Rollout]:
    """Segments gathered by rollout, in order of first appearance."""
    rollouts: dict[str, Rollout] = {}
    for trajectory in trajectories:
        rollouts.setdefault(trajectory.rollout_id, []).append(trajectory)
    return list(rollouts.values())


def _rollout_stats(rollouts: list[Rollout]) -> dict:
    if not rollouts:
        return {"reward/mean": 0.0, "reward/std": 0.0, "response_len/mean": 0.0, "episodes/truncated_frac": 0.0}
    rewards = np.array([rollout[0].reward for rollout in rollouts])
    return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "response_len/mean": float(np.mean([_trainable(rollout) for rollout in rollouts])),
            "episodes/truncated_frac": float(np.mean([rollout[0].truncated for rollout in rollouts]))}


def env_stats(rollouts: list[Rollout]) -> dict:
    """`env/<key>`: the mean over the rollouts that report it of each numeric field of an episode's info (the
    environment's last step, or what an agent returned); a flag (bool) averages to a fraction."""
    values: dict[str, list[float]] = {}
    for rollout in rollouts:
        for key, value in rollout[0].info.items():
            if isinstance(value, (bool, int, float, np.number)):
                values.setdefault(key, []).append(float(value))
    return {f"env/{key}": float(np.mean(found)) for key, found in sorted(values.items())}


def _age_stats(trajectories: list[Trajectory], version: int) -> dict:
    """Staleness of every sampled token: policy versions behind the one the trainer holds."""
    ages = [version - v for t in trajectories for v, m in zip(t.versions, t.mask) if m]
    return {"staleness/mean": float(np.mean(ages)) if ages else 0.0, "staleness/max": max(ages, default=0),
            "staleness/histogram": dict(Counter(ages))}


def _advantages(rollouts: list[Rollout], algo: AlgoConfig) -> tuple[list[float], list[bool], dict]:
    """One advantage per rollout from its reward (less its overlong penalty) and its group's, and whether the
    rollout trains: False for a group of equal rewards when `filter_zero_variance` is on, and for an episode
    cut short under `mask_truncated` (its reward still counts in its group's baseline)."""
    if not rollouts:
        return [], [], {}
    rewards = torch.tensor([rollout[0].reward for rollout in rollouts], dtype=torch.float32)
    group_of = {g: i for i, g in enumerate(sorted({rollout[0].group_id for rollout in rollouts}))}
    groups = torch.tensor([group_of[rollout[0].group_id] for rollout in rollouts])
    lengths = torch.tensor([_trainable(rollout) for rollout in rollouts], dtype=torch.float32)
    stats = {}
    if algo.overlong_buffer:
        penalty = overlong_penalty(lengths, algo.overlong_limit, algo.overlong_buffer, algo.overlong_penalty)
        rewards = rewards + penalty
        stats |= {"overlong/penalty_mean": float(penalty.mean()),
                  "overlong/penalized_frac": float((penalty < 0).float().mean())}
    advantages = ESTIMATORS[algo.estimator](rewards, groups, lengths).tolist()
    trains = torch.ones(len(rollouts), dtype=torch.bool)
    if algo.mask_truncated:
        cut = torch.tensor([_cut_short(rollout) for rollout in rollouts])
        trains &= ~cut
        stats["overlong/masked_frac"] = float(cut.float().mean())
    if algo.filter_zero_variance:
        flat = zero_variance_groups(rewards, groups)
        trains &= ~flat
        stats["filter/zero_variance_frac"] = float(flat.float().mean())
    return advantages, trains.tolist(), stats


def _cut_short(rollout: Rollout) -> bool:
    """The episode hit a turn or token budget, or its last reply was cut at max_tokens."""
    return rollout[0].truncated or rollout[-1].finish_reason == "length"


def _bound_staleness(rollouts: list[Rollout], version: int,
                     algo: AlgoConfig) -> tuple[list[Rollout | None], dict]:
    """Each rollout within `max_staleness`: None where a stale token drops it (`drop`), or with its stale
    tokens taken out of the mask (`mask`)."""
    bounded, stale_count = [], 0
    for rollout in rollouts:
        stale = [stale_tokens(torch.tensor(t.versions), torch.tensor(t.mask), version, algo.max_staleness).tolist()
                 for t in rollout]
        stale_count += sum(map(sum, stale))
        if not any(map(any, stale)):
            bounded.append(rollout)
        elif algo.staleness_mode == "drop":
            bounded.append(None)
        else:
            bounded.append([replace(t, mask=[0 if s else m for s, m in zip(flags, t.mask)])
                            for t, flags in zip(rollout, stale)])
    return bounded, {"staleness/dropped_rollouts": bounded.count(None), "staleness/stale_tokens": stale_count}


def _train_items(rollout: Rollout, advantage: float, version: int) -> list[TrainItem]:
    """The rollout's segments that still train a token, each token with its age."""
    return [TrainItem(token_ids=t.token_ids, mask=t.mask, logprobs=t.logprobs,
                      ages=[version - v if m else 0 for v, m in zip(t.versions, t.mask)], advantage=advantage,
                      routes=t.routes, images=t.mm["tensors"] if t.mm else None, key=segment_key(t))
            for t in rollout if any(t.mask)]


def segment_key(trajectory: Trajectory) -> str:
    """A trajectory segment's name within a step: its rollout and its place in it."""
    return f"{trajectory.rollout_id}/{trajectory.segment}"


def _trained_stats(items: list[TrainItem], rollouts: int, groups: list[Group]) -> dict:
    ages = [{age for age, m in zip(item.ages, item.mask) if m} for item in items]
    return {"tokens/trained": sum(sum(item.mask) for item in items), "rollouts/trained": rollouts,
            "staleness/trained_max": max((max(a) for a in ages), default=0),
            # partial rollouts: the weights changed while the segment was sampled
            "versions/mixed_trajectories": sum(len(a) > 1 for a in ages),
            "data/groups": sorted(group.index for group in groups)}


def _trainable(rollout: Rollout) -> int:
    return sum(t.num_trainable for t in rollout)
