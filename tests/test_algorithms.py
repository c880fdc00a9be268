"""Every estimator, loss, KL estimator, importance-sampling mode and the objective that combines them against
hand-computed values."""

import dataclasses
import math

import pytest
import torch

from molt_train.algorithms.advantages import ESTIMATORS, kl_penalized_advantages, zero_variance_groups
from molt_train.algorithms.losses import entropy_from_logits, gspo_loss, kl, ppo_clip_loss
from molt_train.algorithms.objective import objective
from molt_train.algorithms.off_policy import importance_weights, mismatch, stale_tokens
from molt_train.algorithms.overlong import overlong_penalty

T = torch.tensor
# Two groups of two rollouts: rewards 1, 0 | 1, 1.
REWARDS, GROUPS = T([1.0, 0.0, 1.0, 1.0]), T([0, 0, 1, 1])


def approx(values, expected, tol=1e-5):
    assert torch.allclose(values, T(expected), atol=tol), values


def test_grpo_and_gspo():
    # group 0: mean .5, std .5 -> +1, -1; group 1: std 0 -> 0, 0
    approx(ESTIMATORS["grpo"](REWARDS, GROUPS), [1.0, -1.0, 0.0, 0.0], 1e-4)
    approx(ESTIMATORS["gspo"](REWARDS, GROUPS), [1.0, -1.0, 0.0, 0.0], 1e-4)


def test_dr_grpo():
    approx(ESTIMATORS["dr_grpo"](REWARDS, GROUPS), [0.5, -0.5, 0.0, 0.0])


def test_rloo():
    rewards, groups = T([1.0, 0.0, 0.5]), T([0, 0, 0])
    # 1 - (0 + .5)/2 = .75; 0 - (1 + .5)/2 = -.75; .5 - (1 + 0)/2 = 0
    approx(ESTIMATORS["rloo"](rewards, groups), [0.75, -0.75, 0.0])


def test_reinforce_pp_whitens_over_the_batch():
    # mean .75, population std sqrt(.1875) = .4330
    approx(ESTIMATORS["reinforce_pp"](REWARDS, GROUPS), [0.57735, -1.73205, 0.57735, 0.57735], 1e-4)
    # weighted by lengths 1, 1, 2, 0: mean (1 + 0 + 2)/4 = .75, var (.0625 + .5625 + 2 * .0625)/4 = .1875
    approx(ESTIMATORS["reinforce_pp"](REWARDS, GROUPS, T([1.0, 1.0, 2.0, 0.0])),
           [0.57735, -1.73205, 0.57735, 0.57735], 1e-4)


def test_reinforce_pp_baseline():
    # centered: .5, -.5, 0, 0; std around 0 = sqrt((.25 + .25)/4) = .35355
    approx(ESTIMATORS["reinforce_pp_baseline"](REWARDS, GROUPS), [1.41421, -1.41421, 0.0, 0.0], 1e-4)


def test_zero_variance_groups():
    assert zero_variance_groups(REWARDS, GROUPS).tolist() == [False, False, True, True]


def test_overlong_penalty_at_its_boundaries_hand_computed():
    # limit 20, buffer 4: free up to 16 tokens, then -1/4 per token to -1 at 20, and -1 beyond
    lengths = torch.tensor([0, 16, 17, 18, 19, 20, 21, 500])
    approx(overlong_penalty(lengths, 20, 4), [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    approx(overlong_penalty(lengths, 20, 4, scale=0.5), [0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5, -0.5])
    approx(overlong_penalty(lengths, 20, 20), [0.0, -0.8, -0.85, -0.9, -0.95, -1.0, -1.0, -1.0])  # the buffer is all
    approx(overlong_penalty(lengths, 20, 0), [0.0] * 8)  # off


def test_ppo_clip_loss_hand_computed():
    old = T([0.0, 0.0, 0.0, 0.0])
    new = T([math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.5)])
    adv = T([1.0, 1.0, -1.0, -1.0])
    mask = T([1.0, 1.0, 1.0, 1.0])
    # ratios 1.5, .5, 1.1, .5; clip [.8, 1.28]
    # A>0: max(-1.5, -1.28) = -1.28; max(-.5, -.8) = -.5
    # A<0: max(1.1, 1.1) = 1.1;     max(.5, .8) = .8
    loss, clipped = ppo_clip_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28 - 0.5 + 1.1 + 0.8, abs=1e-5)
    assert clipped.item() == pytest.approx(0.5)  # tokens 0 and 3
    # dual clip 1.05 bounds the negative-advantage tokens by 1.05 * |A|: 1.1 -> 1.05
    loss, _ = ppo_clip_loss(new, old, adv, mask, 0.2, 0.28, dual_clip=1.05)
    assert loss.item() == pytest.approx(-1.28 - 0.5 + 1.05 + 0.8, abs=1e-5)
    # masked tokens and importance weights
    loss, _ = ppo_clip_loss(new, old, adv, T([1.0, 0.0, 0.0, 1.0]), 0.2, 0.28, weights=T([2.0, 1.0, 1.0, 0.5]))
    assert loss.item() == pytest.approx(-1.28 * 2 + 0.8 * 0.5, abs=1e-5)


def test_ppo_gradient_is_the_policy_gradient_at_ratio_one():
    logprobs = T([-1.0, -2.0], requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, logprobs.detach(), T([2.0, -1.0]), T([1.0, 1.0]))
    loss.backward()
    approx(logprobs.grad, [-2.0, 1.0])  # -A * d ratio / d logp = -A


def test_gspo_uses_the_sequence_geometric_ratio():
    old = T([0.0, 0.0, 0.0])
    new = T([0.2, 0.4, -0.1])
    seq = T([0, 0, 1])
    adv = T([1.0, 1.0, -1.0])
    # sequence 0: exp(mean(.2, .4)) = exp(.3) = 1.34986, clipped to 1.0004 -> -1.0004 per token
    # sequence 1: exp(-.1) = .904837, clipped up to .9997 -> max(.904837, .9997) = .9997
    loss, _ = gspo_loss(new, old, adv, T([1.0, 1.0, 1.0]), seq)
    assert loss.item() == pytest.approx(-1.0004 * 2 + 0.9997, abs=1e-5)


def test_kl_estimators():
    logp, ref = T([-1.0]), T([-1.5])  # log r = .5
    assert kl(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    # a token the policy gives e^-14 of the reference's probability: k3 would be e^14 - 15 with a gradient
    # of about -e^14; capped at 10, without gradient (the token at e^-2 keeps its own: 1 - e^2)
    logp = torch.tensor([-15.0, -3.0], requires_grad=True)
    value = kl(logp, T([-1.0, -1.0]), "k3")
    assert value.tolist() == pytest.approx([10.0, math.exp(2) - 3])
    value.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 1 - math.exp(2)])
    with pytest.raises(ValueError, match="k4"):
        kl(logp, ref, "k4")


def test_entropy():
    assert entropy_from_logits(T([[0.0, 0.0]])).item() == pytest.approx(math.log(2))


TRAINER = T([-1.0, -1.0, -1.0, -2.0])
ENGINE = T([-1.5, -0.5, -1.0, -2.0])  # token ratios e^.5, e^-.5, 1, 1
MASK, SEQ = T([1.0, 1.0, 1.0, 1.0]), T([0, 0, 1, 1])


def test_importance_token_level_modes():
    e5, em5 = math.exp(0.5), math.exp(-0.5)
    weights, keep = importance_weights(TRAINER, ENGINE, MASK, SEQ, "token", "truncate", high=1.5)
    approx(weights, [1.5, em5, 1.0, 1.0])
    assert keep.all()
    weights, keep = importance_weights(TRAINER, ENGINE, MASK, SEQ, "token", "clip", low=0.7, high=1.5)
    approx(weights, [1.5, 0.7, 1.0, 1.0])
    weights, keep = importance_weights(TRAINER, ENGINE, MASK, SEQ, "token", "mask", low=0.7, high=1.5)
    approx(weights, [0.0, 0.0, 1.0, 1.0])
    assert keep.tolist() == [False, False, True, True]
    assert e5 > 1.5 and em5 < 0.7


def test_importance_sequence_and_geometric_levels():
    # sequence 0: log ratios .5 and -.5 -> sum 0, mean 0 -> ratio 1; sequence 1: ratio 1
    weights, _ = importance_weights(TRAINER, ENGINE, MASK, SEQ, "seq", "mask", low=0.9, high=1.1)
    approx(weights, [1.0, 1.0, 1.0, 1.0])
    engine = T([-1.5, -1.5, -1.0, -2.0])  # sequence 0: log ratios .5, .5 -> seq e^1, geo e^.5
    weights, _ = importance_weights(TRAINER, engine, MASK, SEQ, "seq", "truncate", high=10.0)
    approx(weights, [math.e, math.e, 1.0, 1.0])
    weights, keep = importance_weights(TRAINER, engine, MASK, SEQ, "geo", "mask", low=0.5, high=1.5)
    approx(weights, [0.0, 0.0, 1.0, 1.0])
    assert keep.tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="level"):
        importance_weights(TRAINER, engine, MASK, SEQ, "word", "mask")


def test_staleness_and_mismatch():
    versions, mask = T([-1, 3, 5, 6]), T([0, 1, 1, 1])
    assert stale_tokens(versions, mask, current_version=6, max_staleness=1).tolist() == [False, True, False, False]
    kl_sum, max_abs = mismatch(TRAINER, ENGINE, MASK)
    assert max_abs == pytest.approx(0.5)
    assert kl_sum == pytest.approx((math.exp(0.5) - 1.5) + (math.exp(-0.5) - 0.5))
    assert mismatch(TRAINER, ENGINE, T([0.0, 1.0, 0.0, 0.0])) == pytest.approx((math.exp(-0.5) - 0.5, 0.5))
    assert mismatch(TRAINER, ENGINE, T([0.0, 0.0, 0.0, 0.0])) == (0.0, None)  # no token: no max


def test_kl_as_reward_subtracts_the_kl_still_to_come():
    advantages = T([1.0, 1.0, 1.0, -1.0, -1.0])
    kl_values = T([9.0, 1.0, 2.0, 9.0, 3.0])
    mask = T([0.0, 1.0, 1.0, 0.0, 1.0])
    sequence = T([0, 0, 0, 1, 1])
    # masked kl 0, 1, 2 | 0, 3 -> to come: 3, 3, 2 | 3, 3
    approx(kl_penalized_advantages(advantages, kl_values, mask, sequence, beta=0.5),
           [1 - 1.5, 1 - 1.5, 1 - 1.0, -1 - 1.5, -1 - 1.5])


def test_learning_rate_schedules_by_hand():
    from molt_train.actor.policy import lr_factor

    def f(step, schedule, warmup=0):
        return lr_factor(step, warmup_steps=warmup, total_steps=10, schedule=schedule, min_ratio=0.1)

    assert [f(s, "constant", warmup=2) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert f(0, "linear") == 1.0 and abs(f(5, "linear") - 0.55) < 1e-12 and abs(f(10, "linear") - 0.1) < 1e-12
    assert f(0, "cosine") == 1.0 and abs(f(5, "cosine") - 0.55) < 1e-12 and abs(f(10, "cosine") - 0.1) < 1e-12
    assert abs(f(2, "cosine") - (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))) < 1e-12
    assert abs(f(4, "linear", warmup=2) - (0.1 + 0.9 * (1 - 2 / 8))) < 1e-12  # decay starts after warmup


def _algo(**changes):
    from molt_train.config import AlgoConfig

    return dataclasses.replace(AlgoConfig(), **changes)


# The objective: four tokens in two sequences, the last one not trained. Old weights = the ones trained (every
# PPO ratio 1, nothing clipped); the engine's logprobs give importance ratios 1, 3 (past is_high 2: dropped),
# 0.5 and 1; the reference gives k1 KL 0.5, 2, 0.25, 0.
OLD = T([-1.0, -1.0, -1.0, -1.0])
ENGINE_LP = T([-1.0, -1.0 - math.log(3), -1.0 + math.log(2), -1.0])
REF = T([-1.5, -3.0, -1.25, -1.0])
ADVANTAGES, TRAINED, SEQUENCE = T([1.0, 1.0, -2.0, 5.0]), T([1.0, 1.0, 1.0, 0.0]), T([0, 0, 1, 1])
ENTROPY = T([1.0, 2.0, 3.0, 4.0])
MASKED_IS = dict(is_mode="mask", is_high=2.0, kl_estimator="k1", kl_coef=0.1, entropy_coef=0.01)


def test_objective_with_kl_as_a_loss_term_and_an_entropy_bonus_hand_computed():
    terms = objective(_algo(**MASKED_IS), OLD.clone(), OLD, REF, ENGINE_LP, ADVANTAGES, TRAINED, SEQUENCE, ENTROPY)
    # surrogate -A * ratio * weight on the kept tokens 0 and 2: -1 * 1 + 2 * 0.5 = 0
    # KL term 0.1 * (0.5 + 0.25) = 0.075; entropy bonus -0.01 * (1 + 3) = -0.04
    assert terms.loss.item() == pytest.approx(0.035, abs=1e-6)
    assert terms.kept_tokens == 2 and terms.clipped_frac == 0.0
    assert terms.kl_sum == pytest.approx(2.75) and terms.entropy_sum == pytest.approx(6.0)  # every trainable token


def test_objective_with_kl_in_the_reward_hand_computed():
    terms = objective(_algo(**MASKED_IS, kl_in_reward=True), OLD.clone(), OLD, REF, ENGINE_LP, ADVANTAGES, TRAINED,
                      SEQUENCE, ENTROPY)
    # advantages less 0.1 x the kept tokens' KL still to come: 1 - 0.05 = 0.95 and -2 - 0.025 = -2.025
    # surrogate -0.95 * 1 + 2.025 * 0.5 = 0.0625; no KL loss term; entropy bonus -0.04
    assert terms.loss.item() == pytest.approx(0.0225, abs=1e-6)
    assert terms.kl_sum == pytest.approx(2.75)  # still measured


def test_objective_uses_the_sequence_ratio_for_gspo_and_nothing_without_reference_or_entropy():
    logprobs, old = T([math.log(1.5), math.log(0.5)], requires_grad=True), T([0.0, 0.0])
    args = (logprobs, old, None, old, T([1.0, 1.0]), T([1.0, 1.0]), T([0, 0]))
    ppo = objective(_algo(clip_low=0.2, clip_high=0.28), *args)
    assert ppo.loss.item() == pytest.approx(-1.28 - 0.5, abs=1e-5)  # per-token ratios 1.5 (clipped) and 0.5
    assert ppo.clipped_frac == 0.5 and ppo.kl_sum is None and ppo.entropy_sum is None
    gspo = objective(_algo(estimator="gspo", clip_low=0.2, clip_high=0.28), *args)
    assert gspo.loss.item() == pytest.approx(-2 * math.sqrt(0.75), abs=1e-5)  # the geometric mean, unclipped
    assert gspo.clipped_frac == 0.0
