"""Training and evaluation episodes: two disjoint ranges of environment seeds.

Every episode is an `env.reset(seed=...)`, so the seeds training may draw
define the held-out episodes of every environment, bundled or user-written,
with no code in the environment:

    training    seeds [0, 2**31)        train_seed(run_seed, group_index)
    evaluation  seeds [2**31, 2**32)    eval_seed(episode_index)

and each episode's sampling seed is `sample_seed(run_seed, group_index, index)`.

No run seed and no group index maps a training episode into the evaluation
range (also after a resume, which only continues the group indices), and
both ranges fit every seeding API (NumPy's legacy 32-bit one too).
Evaluation episode i is seed 2**31 + i whatever the run's seed, so the
evaluations during a run, after a resume and by `molt-eval` score the same
episodes.

The runner also passes the split as `options={"split": "train" | "eval"}`.
An environment with data splits of its own (a dataset with a held-out part)
reads it with `split_of(seed, options)` and draws from that part, since
disjoint seeds alone may still pick the same item.
"""

from __future__ import annotations

TRAIN, EVAL = "train", "eval"
SPLITS = (TRAIN, EVAL)
EVAL_SEEDS = 2**31  # the first evaluation seed; every training seed is below it
_SPREAD = 1_000_003  # a prime: runs of different seeds start their groups far apart


def train_seed(run_seed: int, group_index: int) -> int:
    """The environment seed of training group `group_index` in a run seeded `run_seed`."""
    return (run_seed * _SPREAD + group_index) % EVAL_SEEDS


def eval_seed(episode_index: int) -> int:
    """The environment seed of evaluation episode `episode_index` (the same in every run)."""
    if not 0 <= episode_index < EVAL_SEEDS:
        raise ValueError(f"evaluation episode {episode_index} is outside [0, {EVAL_SEEDS})")
    return EVAL_SEEDS + episode_index


def sample_seed(seed: int | None, group_index: int, index: int) -> int | None:
    """The sampling seed of episode `index` of group `group_index` (for evaluation: play `index` of episode
    `group_index`) in a run sampling with `seed`: each episode its own stream (None: unseeded)."""
    return None if seed is None else seed + 7919 * group_index + index


def split_of(seed: int | None, options: dict | None = None) -> str:
    """The split an episode belongs to: `options["split"]` when given, else the seed's range."""
    if options and options.get("split") is not None:
        if options["split"] not in SPLITS:
            raise ValueError(f"options['split'] = {options['split']!r}: expected one of {', '.join(SPLITS)}")
        return options["split"]
    return EVAL if seed is not None and seed >= EVAL_SEEDS else TRAIN
