"""Evaluation: held-out episodes, pass@k, `eval/*` during a run, and `molt-eval` on a checkpoint and an endpoint.

The runs are the real commands in subprocesses (`molt-train` joined to this session's Ray, `molt-eval`,
`molt-serve`) on the tiny chat model; the assertions read what they wrote.
"""

import itertools
import json
import re
import subprocess
import sys

import pytest
from conftest import molt_serve
from hypothesis import given
from hypothesis import strategies as st

from molt_env.split import EVAL, EVAL_SEEDS, TRAIN, eval_seed, split_of, train_seed
from molt_train.algorithms.pass_at_k import pass_at_k
from molt_train.evaluate import summarize

MOLT_TRAIN = [sys.executable, "-m", "molt_train.cli"]
MOLT_EVAL = [sys.executable, "-m", "molt_train.eval_cli"]

# ---------------------------------------------------------------------------
# The split


@given(run_seed=st.integers(-2**70, 2**70), group_index=st.integers(0, 2**62), episode=st.integers(0, EVAL_SEEDS - 1))
def test_no_training_seed_is_an_evaluation_seed(run_seed, group_index, episode):
    from molt_train.rollout import GroupStream

    seed = GroupStream([], 4, 4, 0, run_seed).env_seed(group_index)  # what training draws
    assert 0 <= seed < EVAL_SEEDS <= eval_seed(episode) < 2**32
    assert seed != eval_seed(episode)
    assert (split_of(seed), split_of(eval_seed(episode))) == (TRAIN, EVAL)


def test_the_split_is_the_option_when_given_and_refuses_an_unknown_one():
    assert split_of(5, {"split": "eval"}) == EVAL and split_of(eval_seed(0), {"split": "train"}) == TRAIN
    assert split_of(None) == TRAIN
    with pytest.raises(ValueError, match="expected one of train, eval"):
        split_of(5, {"split": "test"})
    with pytest.raises(ValueError, match="outside"):
        eval_seed(-1)


def test_a_dataset_environment_holds_out_its_evaluation_entries():
    import environments  # noqa: F401  (registers the bundled environments)
    import molt_env

    env = molt_env.make("reasoning_gym:leg_counting", size=40)  # the last 4 entries are held out
    trained = set()
    for group in range(200):
        env.reset(seed=train_seed(0, group), options={"split": TRAIN})
        trained.add(env.index)
    held_out = set()
    for episode in range(50):
        env.reset(seed=eval_seed(episode))  # the seed alone says it
        held_out.add(env.index)
    assert trained == set(range(36)) and held_out == set(range(36, 40))
    env.reset(seed=3, options={"split": EVAL})  # an explicit split wins over the seed
    assert env.index >= 36


# ---------------------------------------------------------------------------
# pass@k (Chen et al. 2021)


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 2 / 5),
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (4, 0, 2, 0.0),
    (3, 2, 2, 1.0),  # only one failure: any two samples include a pass
    (1, 1, 1, 1.0),
])
def test_pass_at_k_against_hand_computed_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(6, 2, 3), (7, 3, 2), (8, 1, 4)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_include_a_pass(n, c, k):
    samples = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws), abs=1e-12)


def test_pass_at_k_refuses_more_draws_than_samples():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_the_summary_of_plays():
    def play(episode, reward, failure=None):
        return {"episode": episode, "reward": reward, "turns": 1, "completion_tokens": 4, "versions": [3],
                "failure": failure}

    # Episode 0 passes 2 of 3 plays, episode 1 none (one play failed, scoring 0); threshold 1.
    plays = [play(0, 1.0), play(0, 1.0), play(0, 0.5), play(1, 0.0), play(1, 0.9), play(1, 0.0, "timeout")]
    summary = summarize(plays, pass_threshold=1.0)
    assert summary["reward"] == pytest.approx(3.4 / 6)
    assert summary["pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert summary["pass@3"] == pytest.approx((1 + 0) / 2)
    assert summary["failed"] == 1 and summary["episodes"] == 2 and summary["version"] == 3
    assert summarize(plays, pass_threshold=0.5)["pass@1"] == pytest.approx((1 + 1 / 3) / 2)


# ---------------------------------------------------------------------------
# During training

RECORDER = """import json
from environments.digit import Digit
from molt_env.split import split_of

class Recorder(Digit):
    def reset(self, *, seed=None, options=None):
        with open({log!r}, "a") as out:
            out.write(json.dumps({{"seed": seed, "split": split_of(seed, options)}}) + "\\n")
        return super().reset(seed=seed, options=options)
"""


def _train(out, ray_address, *flags):
    args = MOLT_TRAIN + ["--out", str(out), "--ray.address", ray_address, "--log.tensorboard", "false",
                         "--rollout.groups_per_step", "4", "--rollout.group_size", "4", *flags]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def _metrics(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory, ray_address):
    """A synchronous run of 2 steps on the tiny dense model evaluating at the start and every 2 steps, resumed to 3 (the last step
    evaluates too); every environment reset of training and evaluation is recorded with its split."""
    root = tmp_path_factory.mktemp("eval-run")
    env, log = root / "recorder.py", root / "resets.jsonl"
    env.write_text(RECORDER.format(log=str(log)))
    out = root / "run"
    # The untrained dense model: its greedy replies differ from prompt to prompt (the warm-started chat model's
    # may all be the same digit), which the comparison of molt-eval's two paths below needs.
    flags = ["--env", f"{env}:Recorder", "--model", "tiny:dense", "--train.async_queue_size", "0", "--eval.every", "2",
             "--eval.at_start", "true", "--eval.episodes", "8", "--algo.filter_zero_variance", "false",
             "--rollout.max_tokens", "12"]
    _train(out, ray_address, *flags, "--steps", "2")
    before = [json.loads(line) for line in log.read_text().splitlines()]
    stdout = _train(out, ray_address, "--resume", "--steps", "3")
    after = [json.loads(line) for line in log.read_text().splitlines()][len(before):]
    return out, before, after, stdout


def test_evaluation_episodes_never_appear_in_training_also_after_a_resume(evaluated_run):
    _, before, after, stdout = evaluated_run
    assert "# resumed with --steps 3 (was 2)" in stdout
    seeds = {(run, split): {r["seed"] for r in resets if r["split"] == split}
             for run, resets in (("before", before), ("after", after)) for split in (TRAIN, EVAL)}
    held_out = {eval_seed(i) for i in range(8)}
    assert seeds["before", EVAL] == held_out and seeds["after", EVAL] == held_out  # the same episodes each time
    assert len(seeds["before", TRAIN]) == 2 * 4 and len(seeds["after", TRAIN]) == 4  # one seed per group
    trained = seeds["before", TRAIN] | seeds["after", TRAIN]
    assert not trained & held_out and not seeds["before", TRAIN] & seeds["after", TRAIN]
    assert all(seed < EVAL_SEEDS for seed in trained)
    # 8 episodes x 1 greedy sample, at steps 0 and 2, then at 3
    assert sum(r["split"] == EVAL for r in before) == 16 and sum(r["split"] == EVAL for r in after) == 8


def test_eval_metrics_at_the_configured_steps(evaluated_run):
    out, *_ = evaluated_run
    rows = _metrics(out)
    assert sorted(rows) == [0, 1, 2, 3]
    evaluated = sorted(step for step, row in rows.items() if "eval/reward" in row)
    assert evaluated == [0, 2, 3]  # at the start, every 2 steps, and the last step
    for step in evaluated:
        row = rows[step]
        assert {"eval/reward", "eval/pass@1", "eval/failed", "eval/turns", "eval/completion_tokens",
                "time/eval"} <= set(row), row
        assert 0.0 <= row["eval/reward"] <= 1.0 and row["eval/episodes"] == 8 and row["eval/failed"] == 0
        assert row["eval/pass@1"] == row["eval/reward"]  # 0/1 rewards, one greedy sample each
        assert row["eval/version"] == step  # synchronous: the weights after `step` optimizer steps
        assert row["time/eval"] > 0
    assert "reward/mean" not in rows[0]  # step 0 is the evaluation alone
    for step in (1, 2, 3):  # the evaluation played nothing the trainer took
        assert rows[step]["rollouts/trained"] <= 16 and len(rows[step]["data/groups"]) == 4
    assert (out / "plots" / "metrics.png").exists()


# ---------------------------------------------------------------------------
# molt-eval

FINGERPRINT = """import hashlib
from environments.digit import Digit

class Fingerprint(Digit):
    '''The digit prompt; the reward is a fingerprint of the whole reply, so equal rewards mean equal replies.'''
    def step(self, action):
        return "", int(hashlib.sha256(action.encode()).hexdigest()[:8], 16) / 2**32, True, False, {}
"""


def _eval(*flags, expect=0, timeout=300):
    result = subprocess.run(MOLT_EVAL + list(flags), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == expect, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def test_molt_eval_gives_a_checkpoint_and_its_molt_serve_endpoint_the_same_greedy_rewards(evaluated_run, tmp_path):
    out, *_ = evaluated_run
    checkpoint = out / "checkpoints" / "step_000003"
    env = tmp_path / "fingerprint.py"
    env.write_text(FINGERPRINT)
    common = ["--env", f"{env}:Fingerprint", "--eval.episodes", "12", "--eval.temperature", "0",
              "--rollout.max_tokens", "8", "--eval.pass_threshold", "0.5"]
    local = _eval("--model", str(checkpoint), *common, "--out", str(tmp_path / "local.json"))
    assert re.search(r"molt-eval: .*12 episodes x 1 at temperature 0.0: reward \d\.\d{3}", local.stdout)
    assert "molt-eval" in local.stderr and "12/12" in local.stderr  # the progress bar

    with molt_serve("--model", str(checkpoint / "policy"), "--api-key", "k3y", "--max-model-len", "512") as (_,
                                                                                                            base_url):
        _eval("--model", "policy", "--base-url", base_url, "--api-key", "k3y", *common,
              "--out", str(tmp_path / "served.json"))

    local, served = (json.loads((tmp_path / name).read_text()) for name in ("local.json", "served.json"))
    assert local["model"] == str(checkpoint / "policy") and served["base_url"] == base_url
    assert len(local["plays"]) == len(served["plays"]) == 12
    for a, b in zip(local["plays"], served["plays"]):
        assert (a["episode"], a["seed"]) == (b["episode"], b["seed"]) and a["seed"] >= EVAL_SEEDS
        assert a["failure"] is None and b["failure"] is None
        assert a["reward"] == b["reward"] and a["turns"] == b["turns"] == 1
        assert a["completion_tokens"] == b["completion_tokens"] > 0
    assert len({p["reward"] for p in local["plays"]}) > 1  # the replies differ between episodes
    assert local["summary"]["reward"] == served["summary"]["reward"]
    assert local["summary"]["version"] == 0 and "version" not in served["summary"]


def test_molt_eval_of_a_run_scores_it_as_it_trained_unless_told_otherwise(evaluated_run, tmp_path):
    """Given the run directory alone, molt-eval takes the run's environment, reply length and evaluation
    episodes from its config.yaml; a flag given overrides one. The report holds each play's text."""
    out, *_ = evaluated_run
    _eval("--model", str(out), "--out", str(tmp_path / "run.json"))
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["model"] == str(out / "checkpoints" / "step_000003" / "policy")
    assert report["env"].endswith("recorder.py:Recorder") and report["rollout"]["max_tokens"] == 12
    assert len(report["plays"]) == 8 and all("<|im_start|>assistant" in p["text"] for p in report["plays"])
    _eval("--model", str(out / "checkpoints" / "step_000002"), "--rollout.max_tokens", "3", "--eval.episodes", "2",
          "--out", str(tmp_path / "short.json"))
    report = json.loads((tmp_path / "short.json").read_text())
    assert report["env"].endswith("recorder.py:Recorder") and report["rollout"]["max_tokens"] == 3
    assert len(report["plays"]) == 2 and all(0 < p["completion_tokens"] <= 3 for p in report["plays"])


def test_molt_eval_bad_input_is_one_line_naming_it(tmp_path):
    (tmp_path / "step_000001").mkdir()
    (tmp_path / "step_000001" / "loop_state.json").write_text("{}")
    cases = [
        (["--model", "tiny:chat", "--env", "no_such_env"], "molt-eval: --env no_such_env: unknown environment"),
        (["--model", str(tmp_path / "step_000001")], f"molt-eval: --model {tmp_path / 'step_000001'}: the checkpoint "
                                                      "has no policy"),
        (["--model", "m", "--base-url", "http://127.0.0.1:9/v1"], "molt-eval: --base_url http://127.0.0.1:9/v1: "
                                                                   "unreachable"),
        (["--model", "tiny:chat", "--eval.samples", "0"], "molt-eval: --eval.samples: must be >= 1"),
        (["--model", "tiny:chat", "--eval.samples", "4"],
         "molt-eval: --eval.samples: 4 greedy samples are all the same"),
        (["--model", "/no/such/model"], "molt-eval: --model /no/such/model: not a Hugging Face model directory"),
    ]
    for flags, message in cases:
        result = _eval(*flags, expect=1, timeout=60)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), (flags, result.stderr[-2000:])
    result = subprocess.run(MOLT_TRAIN + ["--eval.samples", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.strip() == "molt-train: --eval.samples: must be >= 1 (the k of " \
                                                               "pass@k)"
