"""The reward model: the tiny one's preference, its scores in padded batches against a direct transformers
forward, the rule that combines them with the environment's reward, and a run rewarded by it alone."""

import json
import subprocess
import sys

import pytest
import torch

from molt_agents.tiny import tiny_model
from molt_agents.tiny.reward import conversation
from molt_env.trajectory import Trajectory
from molt_train.reward_model import RewardModel, combine


@pytest.fixture(scope="module")
def reward_dir():
    return tiny_model("reward")


def test_scores_in_padded_batches_equal_a_direct_forward_of_each_conversation(reward_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    conversations = [conversation(7, "7"), conversation(3, "8"), conversation(2, "2 when the"),
                     [{"role": "user", "content": "Repeat the digit 5. Then say nothing else at all, please."},
                      {"role": "assistant", "content": "5"}],
                     conversation(0, "zero"), conversation(9, "9"), conversation(4, "the 4")]
    scores = RewardModel(str(reward_dir), batch_size=3).score(conversations)  # batches of 3, 3 and 1, padded
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    for messages, score in zip(conversations, scores):
        ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), return_tensors="pt",
                        add_special_tokens=False)
        with torch.no_grad():
            direct = model(**ids).logits[0, 0].item()
        assert abs(score - direct) <= 1e-5, (messages, score, direct)
    print("scores", [round(s, 3) for s in scores])
    # the preference it was trained on, on its prompt (the fourth is another): the reply starts with the digit
    preferred = [s > 0 for i, s in enumerate(scores) if i != 3]
    assert preferred == [True, False, True, False, True, False]


def test_a_model_that_is_not_a_reward_model_is_refused(tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model("reward"), num_labels=3,
                                                               ignore_mismatched_sizes=True)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model("reward") / name).read_bytes())
    with pytest.raises(ValueError, match="not a reward model .* it has 3 output"):
        RewardModel(str(tmp_path))


def test_combine_adds_the_weighted_score_to_the_environment_reward_or_replaces_it():
    def episode():
        return [Trajectory([1, 2], [None, -0.5], [0, 1], [-1, 0], reward=1.0, info={"digit": "3"}),
                Trajectory([1, 2, 3], [None, None, -0.5], [0, 0, 1], [-1, -1, 0], reward=1.0, segment=1)]

    kept = episode()
    combine(kept, -2.0, 0.5, keep_env=True)
    assert [t.reward for t in kept] == [0.0, 0.0]  # 1 + 0.5 * -2
    assert kept[0].info == {"digit": "3", "env_reward": 1.0, "rm_score": -2.0}
    alone = episode()
    combine(alone, -2.0, 0.5, keep_env=False)
    assert [t.reward for t in alone] == [-1.0, -1.0]


def test_a_run_rewarded_by_the_reward_model_alone_reports_both_rewards(tmp_path, ray_address):
    out = tmp_path / "rm"
    result = subprocess.run([sys.executable, "-m", "molt_train.cli", "--out", str(out), "--ray.address", ray_address,
                             "--steps", "2", "--rollout.groups_per_step", "2", "--rollout.group_size", "4",
                             "--reward.model", "tiny:reward", "--reward.keep_env", "false", "--reward.weight", "0.5",
                             "--log.tensorboard", "false"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "reward model: tiny:reward (weight 0.5, alone)" in result.stdout + result.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # one group's rewards are half the scores; the digit rule is still measured
        assert row["reward/mean"] == pytest.approx(0.5 * row["env/rm_score"], abs=1e-6)
        assert 0 <= row["env/env_reward"] <= 1
    assert len({round(r["reward/mean"], 6) for r in rows}) == 2  # scores, not a constant


def test_an_agent_run_is_scored_by_the_reward_model_on_its_last_chat(tmp_path, ray_address):
    """`--agent` with a reward model: the loopback keeps each episode's last chat request and its reply, and
    the reward model scores that conversation (here alone, weight 0.5)."""
    out = tmp_path / "rm-agent"
    result = subprocess.run([sys.executable, "-m", "molt_train.cli", "--out", str(out), "--ray.address", ray_address,
                             "--agent", "environments.agents:SingleTurnChat", "--steps", "2",
                             "--rollout.groups_per_step", "2", "--rollout.group_size", "4",
                             "--reward.model", "tiny:reward", "--reward.keep_env", "false", "--reward.weight", "0.5",
                             "--log.tensorboard", "false"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print("rm scores", [r["env/rm_score"] for r in rows], "env rewards", [r["env/env_reward"] for r in rows])
    for row in rows:
        assert row["rollouts/trained"] == 8 and row.get("episodes/failed", 0) == 0
        assert row["reward/mean"] == pytest.approx(0.5 * row["env/rm_score"], abs=1e-6)
        assert 0 <= row["env/env_reward"] <= 1
    assert len({round(r["reward/mean"], 6) for r in rows}) == 2  # scores, not a constant


@pytest.mark.parametrize("flags,needle", [
    (["--reward.keep_env", "false"], "--reward.keep_env: false leaves no reward: give --reward.model"),
    (["--reward.model", "tiny:nope"], "--reward.model tiny:nope: no tiny model 'nope'"),
])
def test_reward_flags_that_cannot_run_are_refused_naming_the_flag(flags, needle):
    result = subprocess.run([sys.executable, "-m", "molt_train.cli", *flags], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and needle in result.stderr, result.stderr[-2000:]
