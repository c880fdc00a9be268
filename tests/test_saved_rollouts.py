"""`--log.rollouts`: a run's episodes on disk as trajectory records, once per step across a resume."""

import gzip
import json
import shutil
import subprocess
import sys
from collections import Counter

import pytest

from molt_env.trajectory import Trajectory, check
from molt_train.saved_rollouts import load_index, read, read_member, scan, summary


def _molt_train(out, ray_address, *flags):
    result = subprocess.run([sys.executable, "-m", "molt_train.cli", "--out", str(out), "--ray.address", ray_address,
                             "--rollout.groups_per_step", "2", "--rollout.group_size", "4",
                             "--train.async_queue_size", "0", "--log.tensorboard", "false", "--log.rollouts", "true",
                             "--log.rollouts_every", "2", "--eval.every", "3", "--eval.episodes", "3", *flags],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def _records(out) -> list[dict]:
    return [record for path in sorted((out / "rollouts").glob("*.jsonl.gz")) for record in read(path)]


def test_saved_rollouts_are_trajectory_records_and_a_resumed_run_holds_each_step_once(tmp_path, ray_address):
    out = tmp_path / "run"
    _molt_train(out, ray_address, "--steps", "3", "--ckpt.every", "2")
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["index.jsonl", "steps_000001.jsonl.gz",
                                                                   "steps_000003.jsonl.gz"]
    records = _records(out)
    assert Counter((r["step"], r["split"]) for r in records) == {
        (1, "train"): 8, (2, "train"): 8, (3, "train"): 8, (3, "eval"): 3}
    metrics = {json.loads(line)["step"]: json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()}
    for record in records:
        trajectory = Trajectory.from_dict(record)
        check(trajectory)  # the token-first invariant: masks, logprobs and versions line up
        assert trajectory.messages[0]["content"].startswith("Repeat the digit")
        assert trajectory.messages[-1]["role"] == "assistant"
        assert trajectory.reward == float(trajectory.messages[-1]["content"].strip()[:1] == trajectory.info["digit"])
    for step in (1, 2, 3):  # what was saved is what was trained
        rewards = [r["reward"] for r in records if r["step"] == step and r["split"] == "train"]
        assert sum(rewards) / 8 == metrics[step]["reward/mean"]
        assert sum(sum(r["mask"]) for r in records if r["step"] == step and r["split"] == "train") \
            == metrics[step]["tokens/trained"]
    assert sorted(r["episode"] for r in records if r["split"] == "eval") == [0, 1, 2]
    for step in (1, 2, 3):  # the trainer's logprobs beside the engine's: the step's mismatch, token by token
        trained = [r for r in records if r["step"] == step and r["split"] == "train" and r["trained"]]
        assert all((e is None) == (t is None) for r in trained for e, t in zip(r["logprobs"], r["trainer_logprobs"]))
        gaps = [abs(t - e) for r in trained for e, t in zip(r["logprobs"], r["trainer_logprobs"]) if e is not None]
        assert max(gaps) == pytest.approx(metrics[step]["mismatch/max_abs"], rel=1e-3, abs=1e-6)
        for r in trained:  # each reward less its group's mean, then whitened: the sign survives
            group = [o["reward"] for o in records if o["step"] == step and o["group_id"] == r["group_id"]]
            assert r["advantage"] * (r["reward"] - sum(group) / len(group)) >= 0
        assert all(r["advantage"] is None and r["trainer_logprobs"] is None
                   for r in records if r["step"] == step and r["split"] == "train" and not r["trained"])
    _assert_indexed(out, records)

    # the run stopped after step 3's rollouts were written and before its checkpoint: resume from step 2
    shutil.rmtree(out / "checkpoints" / "step_000003")
    _molt_train(out, ray_address, "--steps", "4", "--ckpt.every", "2", "--resume")
    resumed = _records(out)
    assert Counter((r["step"], r["split"]) for r in resumed) == {
        (1, "train"): 8, (2, "train"): 8, (3, "train"): 8, (3, "eval"): 3, (4, "train"): 8, (4, "eval"): 3}
    assert [r for r in resumed if r["step"] <= 2] == [r for r in records if r["step"] <= 2]
    _assert_indexed(out, resumed)


def _assert_indexed(out, records):
    """index.jsonl: a line per step, each record summarized in order, where `read_member` finds it."""
    index = load_index(out / "rollouts")
    assert index == scan(out / "rollouts")  # what the run appended is what the files hold
    assert [entry["step"] for entry in index] == sorted({r["step"] for r in records})
    for entry in index:
        members = read_member(out / "rollouts" / entry["file"], entry["offset"], entry["size"])
        assert members == [r for r in records if r["step"] == entry["step"]]
        assert entry["records"] == [summary(r) for r in members]


def test_a_half_written_end_is_skipped_and_the_groups_bound_holds(tmp_path, ray_address):
    out = tmp_path / "bounded"
    _molt_train(out, ray_address, "--steps", "2", "--log.rollouts_groups", "1", "--eval.every", "0")
    path = out / "rollouts" / "steps_000001.jsonl.gz"
    whole = list(read(path))
    assert Counter(r["step"] for r in whole) == {1: 4, 2: 4}  # one group of 4 per step
    member = gzip.compress(("".join(json.dumps(r) + "\n" for r in whole[:2])).encode())
    with path.open("ab") as file:  # a run killed while writing its next step
        file.write(member[: len(member) // 2])
    assert list(read(path)) == whole
    assert [entry["step"] for entry in scan(out / "rollouts")] == [1, 2]  # the torn member is not indexed


def test_images_are_saved_as_png_data_urls_and_the_opening_names_the_prompt():
    import base64
    import io

    import numpy as np
    from PIL import Image

    from molt_train.saved_rollouts import prompt, viewable

    picture = np.zeros((4, 6, 3), dtype=np.uint8)
    picture[1, 2] = (255, 0, 0)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Count the shapes."},
                                             {"type": "image", "image": picture}]},
                {"role": "assistant", "content": "3"}]
    saved = viewable(messages)
    url = saved[0]["content"][1]["image"]
    assert url.startswith("data:image/png;base64,") and saved[1] == messages[1]
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    assert np.array_equal(decoded, picture)  # lossless
    assert viewable(saved) == saved and json.loads(json.dumps(saved)) == saved
    opening = prompt(saved)
    assert opening["prompt"] == "Count the shapes. [image]"
    assert opening == prompt(saved[:1]) != prompt([{**saved[0], "content": "Count the shapes."}])
