"""The trainer's step metrics, from trajectory versions to the logged numbers.

`assemble` gives every trained token its age, packing carries it to the
ranks, each rank measures its share and `StepStats.reduce` combines the
ranks' as each field declares. The end-to-end test drives real FSDP2 trainer
ranks (Ray actors over gloo) on the tiny dense model with engine logprobs
that are a transformers forward's plus known offsets, so every metric has a
value computable by hand.
"""

import asyncio
import dataclasses
import math

import pytest
import torch

from molt_env.trajectory import Trajectory
from molt_train.actor.policy import StepStats
from molt_train.batch import assemble
from molt_train.config import AlgoConfig, Config
from molt_train.group import Group
from molt_train.loop import _train_stats

VERSION = 3  # the policy version the trainer holds
FRESH_OFFSET, STALE_OFFSET = 0.1, -0.3  # engine logprob minus the trainer's, by the token's age


def k3(engine_minus_trainer: float) -> float:
    """k3 estimate of KL(engine || trainer) at one token: r - 1 - log r with log r = trainer - engine."""
    d = -engine_minus_trainer
    return math.exp(d) - 1 - d


def test_reduce_by_hand():
    ranks = [StepStats(tokens=3, loss_sum=1.5, grad_norm=2.0, mismatch_tokens=2, mismatch_max_abs=0.1,
                       entropy_sum=0.3),
             StepStats(tokens=5, loss_sum=-0.5, grad_norm=2.0, mismatch_tokens=0, mismatch_max_abs=None,
                       entropy_sum=0.7)]
    group = StepStats.reduce(ranks)
    assert (group.tokens, group.loss_sum, group.mismatch_tokens) == (8, 1.0, 2)  # sums
    assert group.entropy_sum == pytest.approx(1.0)
    assert group.grad_norm == 2.0  # the same on every rank: not multiplied by the world size
    assert group.mismatch_max_abs == 0.1  # a rank without such tokens has no max
    assert group.kl_sum is None  # measured by no rank
    with pytest.raises(ValueError, match="grad_norm differs"):
        StepStats.reduce([StepStats(grad_norm=1.0), StepStats(grad_norm=1.5)])


def test_per_token_metrics_are_none_where_nothing_was_measured():
    metrics = _train_stats(StepStats(tokens=4, loss_sum=2.0, kept_tokens=3, grad_norm=0.5, mismatch_tokens=4,
                                     mismatch_kl_sum=0.02, mismatch_max_abs=0.2))
    assert metrics["loss"] == 0.5 and metrics["is/filtered_frac"] == 0.25 and metrics["grad_norm"] == 0.5
    assert metrics["mismatch/kl"] == pytest.approx(0.005) and metrics["mismatch/tokens"] == 4
    assert metrics["entropy"] is None and metrics["kl"] is None  # not computed: not 0.0
    assert metrics["offpolicy/kl"] is None and metrics["offpolicy/tokens"] == 0
    assert "routing/agreement" not in metrics


# ---------------------------------------------------------------------------
# assemble: ages, staleness control, typed items


def _trajectory(ids, prompt, versions, logprobs, rollout="r0", group="g0", reward=1.0):
    """`versions` and `logprobs` for the generated tokens after a prompt of `prompt` tokens."""
    return Trajectory(token_ids=ids, logprobs=[None] * prompt + logprobs, mask=[0] * prompt + [1] * len(versions),
                      versions=[-1] * prompt + versions, reward=reward, rollout_id=rollout, group_id=group)


def _groups(trajectories, failures=()):
    return [Group(0, list(trajectories), list(failures))]


def test_assemble_gives_each_trained_token_its_age():
    trajectories = [_trajectory([5, 6, 7, 8, 9], 2, [3, 3, 2], [-1.0] * 3, "a", reward=1.0),
                    _trajectory([5, 6, 7, 8], 2, [1, 1], [-1.0] * 2, "b", reward=0.0)]
    items, stats = assemble(_groups(trajectories), VERSION, AlgoConfig(estimator="grpo"))
    assert [item.ages for item in items] == [[0, 0, 0, 0, 1], [0, 0, 2, 2]]
    assert [item.advantage for item in items] == pytest.approx([1.0, -1.0], abs=1e-4)  # (r - mean) / std
    assert stats["staleness/histogram"] == {0: 2, 1: 1, 2: 2} and stats["staleness/trained_max"] == 2
    assert stats["versions/mixed_trajectories"] == 1 and stats["tokens/trained"] == 5


@pytest.mark.parametrize("mode", ["drop", "mask"])
def test_assemble_bounds_staleness(mode):
    # Rollout "old" has two segments; one token of its second is 3 versions old, past the bound of 2.
    trajectories = [_trajectory([5, 6, 7], 1, [3, 3], [-1.0] * 2, "new", reward=1.0),
                    _trajectory([5, 6, 7], 1, [2, 2], [-1.0] * 2, "old", reward=0.0),
                    _trajectory([5, 6, 7, 8], 1, [2, 0, 2], [-1.0] * 3, "old", reward=0.0)]
    invalid = _trajectory([5, 6], 1, [3], [0.5], "bad")  # a positive logprob: not a probability
    items, stats = assemble(_groups(trajectories + [invalid], failures=["RuntimeError: boom"]), VERSION,
                            AlgoConfig(estimator="reinforce_pp", max_staleness=2, staleness_mode=mode))
    assert stats["invalid/trainable_without_logprob"] == 1 and stats["episodes/failed/RuntimeError"] == 1
    assert stats["staleness/stale_tokens"] == 1 and stats["staleness/max"] == 3
    if mode == "drop":  # the whole rollout goes, both segments
        assert [item.token_ids for item in items] == [[5, 6, 7]]
        assert stats["staleness/dropped_rollouts"] == 1 and stats["rollouts/trained"] == 1
    else:  # only the stale token leaves the mask
        assert [item.mask for item in items] == [[0, 1, 1], [0, 1, 1], [0, 1, 0, 1]]
        assert stats["staleness/dropped_rollouts"] == 0 and stats["rollouts/trained"] == 2
    assert stats["tokens/trained"] == sum(sum(item.mask) for item in items)


def test_assemble_shapes_overlong_episodes_and_masks_cut_ones():
    """Rewards 1, 1, 0, 0 with 2, 5, 3 and 6 generated tokens (limit 6, buffer 2: 5 tokens cost 0.5, 6 cost
    1); the rollout cut at max_tokens trains nothing under mask_truncated but counts in the baseline."""
    lengths, rewards = [2, 5, 3, 6], [1.0, 1.0, 0.0, 0.0]
    trajectories = [_trajectory([9] * (1 + n), 1, [VERSION] * n, [-1.0] * n, str(i), reward=r)
                    for i, (n, r) in enumerate(zip(lengths, rewards))]
    trajectories[3].finish_reason = "length"
    algo = AlgoConfig(estimator="dr_grpo", overlong_buffer=2, overlong_limit=6)
    items, stats = assemble(_groups(trajectories), VERSION, algo)
    shaped = [1.0, 0.5, 0.0, -1.0]  # mean 0.125
    assert [item.advantage for item in items] == pytest.approx([r - 0.125 for r in shaped])
    assert stats["overlong/penalty_mean"] == pytest.approx(-1.5 / 4) and stats["overlong/penalized_frac"] == 0.5
    assert stats["reward/mean"] == 0.5  # the environment's reward, as it was
    items, stats = assemble(_groups(trajectories), VERSION, dataclasses.replace(algo, mask_truncated=True))
    assert [item.advantage for item in items] == pytest.approx([0.875, 0.375, -0.125])
    assert stats["overlong/masked_frac"] == 0.25 and stats["rollouts/trained"] == 3
    trajectories[3].finish_reason, trajectories[2].truncated = "stop", True  # a turn budget hit
    items, _ = assemble(_groups(trajectories), VERSION, AlgoConfig(estimator="dr_grpo", mask_truncated=True))
    assert [item.advantage for item in items] == pytest.approx([0.5, 0.5, -0.5])  # rollouts 0, 1 and 3


# ---------------------------------------------------------------------------
# Real trainer ranks: every metric against its hand-computed value


def _forward(model_dir, ids):
    """Per-token logprob and entropy of the prediction of each token (0 for the first), by a plain forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    logprobs = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return [0.0] + logprobs.tolist(), [0.0] + entropy.tolist()


def _known_batch(model_dir):
    """Four rollouts whose tokens were sampled by the trainer's weights (age 0) or by older ones (age 1 or 2);
    the engine's logprobs are the transformers forward's plus FRESH_OFFSET or STALE_OFFSET."""
    generator = torch.Generator().manual_seed(0)
    trajectories = []
    for i, (length, prompt) in enumerate([(20, 6), (28, 8), (16, 5), (24, 7)]):
        ids = torch.randint(3, 1000, (length,), generator=generator).tolist()
        logprobs, _ = _forward(model_dir, ids)
        # Rollouts 0 and 2 are fresh; 1 and 3 alternate fresh tokens and tokens 1 or 2 versions old.
        versions = [VERSION if i % 2 == 0 or j % 2 == 0 else VERSION - 1 - (j % 4 == 1) for j in range(prompt, length)]
        engine = [logprobs[j] + (FRESH_OFFSET if v == VERSION else STALE_OFFSET)
                  for j, v in zip(range(prompt, length), versions)]
        trajectories.append(_trajectory(ids, prompt, versions, engine, f"r{i}", group="g0", reward=float(i % 3)))
    return trajectories


def _step(model_dir, start_dir, items, world_size, **algo):
    """One trainer step of a fresh group of `world_size` ranks; its metrics."""
    import ray

    from molt_train.placement import Placement
    from molt_train.trainer import TrainerGroup, rendezvous

    config = Config(steps=1)
    config.actor.world_size = world_size
    config.train.micro_batch_tokens = 32  # a micro-batch per rollout, two per rank
    for key, value in algo.items():
        setattr(config.algo, key, value)

    async def run():
        placement = await Placement.reserve(config)
        group = TrainerGroup(str(model_dir), str(start_dir), config, placement, await rendezvous(placement))
        try:
            return _train_stats(await group.step(items))
        finally:
            await group.close()
            for rank in group.ranks:
                ray.kill(rank)
            placement.remove()

    return asyncio.run(run())


def test_two_rank_step_metrics_equal_their_hand_computed_values(ray_address, dense_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trajectories = _known_batch(dense_dir)
    items, _ = assemble(_groups(trajectories), VERSION, AlgoConfig())
    fresh = sum(v == VERSION for t in trajectories for v, m in zip(t.versions, t.mask) if m)
    stale = sum(m for t in trajectories for m in t.mask) - fresh
    assert fresh and stale

    single = _step(dense_dir, dense_dir, items, 1, kl_coef=0.0, entropy_coef=0.0)
    double = _step(dense_dir, dense_dir, items, 2, kl_coef=0.0, entropy_coef=0.0)
    print(f"grad_norm: world size 1 {single['grad_norm']:.6f}, 2 {double['grad_norm']:.6f}; "
          f"mismatch/kl {double['mismatch/kl']:.6f} (expected {k3(FRESH_OFFSET):.6f}), "
          f"max_abs {double['mismatch/max_abs']:.6f}; offpolicy/kl {double['offpolicy/kl']:.6f} "
          f"(expected {k3(STALE_OFFSET):.6f})")
    for metrics in (single, double):
        # Only the tokens of the trainer's own weights measure the engine; the stale ones are apart.
        assert metrics["mismatch/tokens"] == fresh and metrics["offpolicy/tokens"] == stale
        assert metrics["mismatch/kl"] == pytest.approx(k3(FRESH_OFFSET), rel=1e-4)
        assert metrics["mismatch/max_abs"] == pytest.approx(abs(FRESH_OFFSET), abs=1e-5)
        assert metrics["offpolicy/kl"] == pytest.approx(k3(STALE_OFFSET), rel=1e-4)
        assert metrics["entropy"] is None and metrics["kl"] is None  # no entropy bonus, no reference model
        assert metrics["clip_frac"] == 0.0 and metrics["is/filtered_frac"] == 0.0  # ratio 1 at the first update
    assert double["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)  # the global norm, once
    assert double["loss"] == pytest.approx(single["loss"], rel=1e-5, abs=1e-7)

    # Resuming: the policy starts from another checkpoint, the KL anchor stays the run's model.
    start = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    with torch.no_grad():
        start.lm_head.weight.mul_(1.5)
    start.save_pretrained(tmp_path / "checkpoint")
    with_terms = _step(dense_dir, tmp_path / "checkpoint", items, 2, kl_coef=0.1, entropy_coef=0.01)
    kl_values, entropies = [], []
    for t in trajectories:
        policy, entropy = _forward(tmp_path / "checkpoint", t.token_ids)
        reference, _ = _forward(dense_dir, t.token_ids)
        kl_values += [math.exp(r - p) - 1 + (p - r) for p, r, m in zip(policy, reference, t.mask) if m]
        entropies += [e for e, m in zip(entropy, t.mask) if m]
    expected_kl, expected_entropy = sum(kl_values) / len(kl_values), sum(entropies) / len(entropies)
    print(f"kl {with_terms['kl']:.6f} (expected {expected_kl:.6f}), entropy {with_terms['entropy']:.6f} "
          f"(expected {expected_entropy:.6f})")
    assert expected_kl > 1e-3, "the checkpoint is too close to the model for the test to tell them apart"
    assert with_terms["kl"] == pytest.approx(expected_kl, rel=1e-4)
    assert with_terms["entropy"] == pytest.approx(expected_entropy, rel=1e-5)
