"""From finished groups to the trainer's batch: validation, staleness, advantages, filtering.

Pure bookkeeping over trajectory records; the math lives in `algorithms/`.
A rollout (all its segments) is one sample for the group baseline; its
advantage is broadcast to the trainable tokens of every segment.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from molt_env.trajectory import Trajectory, validate
from molt_train.algorithms.advantages import ESTIMATORS, zero_variance_groups


def assemble(groups: list[dict], version: int, algo) -> tuple[list[dict], dict]:
    """Training items (dicts for `packing.pack`) and the batch's metrics."""
    stats: dict = {}
    invalid = Counter()
    trajectories = []
    for group in groups:
        for record in group["trajectories"]:
            trajectory = Trajectory.from_dict(record)
            reason = validate(trajectory)
            if reason:
                invalid[reason] += 1
            else:
                trajectories.append(trajectory)
    failures = [f for group in groups for f in group["failures"]]
    stats["episodes/failed"] = len(failures)
    for reason, count in Counter(f.split(":", 1)[0] for f in failures).items():
        stats[f"episodes/failed/{reason}"] = count
    if failures:
        stats["episodes/failure_example"] = failures[0]
    for reason, count in invalid.items():
        stats[f"invalid/{reason}"] = count

    # One reward per rollout; all of a rollout's segments share it.
    rollouts: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        rollouts.setdefault(trajectory.rollout_id, []).append(trajectory)
    ids = list(rollouts)
    rewards = torch.tensor([rollouts[r][0].reward for r in ids], dtype=torch.float32)
    group_of = {g: i for i, g in enumerate(sorted({rollouts[r][0].group_id for r in ids}))}
    groups_index = torch.tensor([group_of[rollouts[r][0].group_id] for r in ids])
    lengths = torch.tensor([sum(t.num_trainable for t in rollouts[r]) for r in ids], dtype=torch.float32)
    stats["reward/mean"] = float(rewards.mean()) if len(ids) else 0.0
    stats["reward/std"] = float(rewards.std(unbiased=False)) if len(ids) else 0.0
    stats["response_len/mean"] = float(lengths.mean()) if len(ids) else 0.0
    stats["episodes/truncated_frac"] = float(np.mean([rollouts[r][0].truncated for r in ids])) if ids else 0.0

    # Staleness: versions behind the current policy, per trainable token.
    ages = [version - v for t in trajectories for v, m in zip(t.versions, t.mask) if m]
    stats["staleness/mean"] = float(np.mean(ages)) if ages else 0.0
    stats["staleness/max"] = int(max(ages)) if ages else 0
    stats["staleness/histogram"] = dict(Counter(ages))
    keep = torch.ones(len(ids), dtype=torch.bool)
    stale_tokens = 0
    for i, r in enumerate(ids):
        for trajectory in rollouts[r]:
            stale = [m and version - v > algo.max_staleness for v, m in zip(trajectory.versions, trajectory.mask)]
            if any(stale):
                if algo.staleness_mode == "drop":
                    keep[i] = False
                else:
                    trajectory.mask = [0 if s else m for s, m in zip(stale, trajectory.mask)]
                stale_tokens += sum(stale)
    stats["staleness/dropped_rollouts"] = int((~keep).sum())
    stats["staleness/stale_tokens"] = stale_tokens

    if len(ids):
        advantages = ESTIMATORS[algo.estimator](rewards, groups_index, lengths)
    else:
        advantages = rewards
    if algo.filter_zero_variance and len(ids):
        flat = zero_variance_groups(rewards, groups_index)
        stats["filter/zero_variance_frac"] = float(flat.float().mean())
        keep &= ~flat
    items, trained_ages, mixed = [], [], 0
    for i, r in enumerate(ids):
        if not keep[i]:
            continue
        for trajectory in rollouts[r]:
            if any(trajectory.mask):
                items.append({"token_ids": trajectory.token_ids, "mask": trajectory.mask,
                              "logprobs": trajectory.logprobs, "advantage": float(advantages[i]),
                              "routes": trajectory.routes,
                              "images": trajectory.mm["tensors"] if trajectory.mm else None})
                sampled_by = {v for v, m in zip(trajectory.versions, trajectory.mask) if m}
                trained_ages += [version - v for v in sampled_by]
                mixed += len(sampled_by) > 1  # partial rollout: weights changed mid-sequence
    stats["tokens/trained"] = sum(sum(item["mask"]) for item in items)
    stats["rollouts/trained"] = int(keep.sum())
    stats["staleness/trained_max"] = max(trained_ages, default=0)
    stats["versions/mixed_trajectories"] = mixed
    stats["data/groups"] = sorted(group["group_index"] for group in groups)
    return items, stats
