"""Weights & Biases: a real run logged offline holds the metrics, the config and the episode table, and a
resumed run continues the same W&B run; without the package, `--log.wandb true` is refused before any work.
Which episodes the table shows, and as what text, is checked on hand-made groups.

W&B runs offline here (WANDB_MODE=offline: nothing leaves the machine). A run writes
RUN_DIR/wandb/offline-run-<time>-<id>/: `run-<id>.wandb`, the protobuf records `wandb sync` uploads (read by
`_records` below), and each logged table as a JSON file under files/, named in the history record of its step.
"""

import json
import os
import struct
import subprocess
import sys

import pytest

from molt_train.metrics import prompt_and_reply

MOLT_TRAIN = [sys.executable, "-m", "molt_train.cli"]


def _records(path):
    """The `Record`s of a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB's log format,
    32 KiB blocks of chunks, each behind a 7-byte header (CRC, length, type: 1 whole, 2 first, 3 middle, 4 last)
    and no chunk header across a block's end (its last bytes are zeros)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", f"{path} is not a W&B data file"
    position, pieces = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:  # zero padding to the block's end
            position += block - position % block
            continue
        pieces += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def _offline_run(run_dir):
    """What an offline W&B run holds: its `run` record, its config (sections as nested dicts), its history by
    step (nested keys as nested dicts) and its files/ folder. Several runs (a resumed one) add up."""
    runs = sorted(run_dir.glob("wandb/offline-run-*"))
    assert runs, f"no offline W&B run under {run_dir / 'wandb'}"
    first, config, history = None, {}, {}
    for folder in runs:
        (data,) = folder.glob("run-*.wandb")
        for record in _records(data):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                first = first or record.run
                config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "config":
                config |= {item.key: json.loads(item.value_json) for item in record.config.update}
            elif kind == "history":
                row = {}
                for item in record.history.item:
                    *parents, leaf = list(item.nested_key) or [item.key]
                    node = row
                    for key in parents:
                        node = node.setdefault(key, {})
                    node[leaf] = json.loads(item.value_json)
                history.setdefault(row["_step"], {}).update(row)
    return first, config, history, [folder / "files" for folder in runs]


def _env(tmp_path):
    """Offline, quiet, and every W&B folder (cache, staged artifacts, settings) in the test's own directory."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    home = tmp_path / "wandb-home"
    return env | {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "molt-test",
                  "WANDB_DIR": str(home), "WANDB_CACHE_DIR": str(home / "cache"),
                  "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_DATA_DIR": str(home / "data")}


def _train(out, ray_address, env, *flags):
    args = MOLT_TRAIN + ["--out", str(out), "--ray.address", ray_address, "--rollout.groups_per_step", "2",
                         "--rollout.group_size", "4", "--train.async_queue_size", "0", "--log.tensorboard", "false",
                         "--log.wandb", "true", *flags]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory, ray_address):
    """A synchronous run of 2 steps on the tiny chat model with W&B on, offline, then resumed to step 3."""
    root = tmp_path_factory.mktemp("wandb-run")
    out, env = root / "run", _env(root)
    _train(out, ray_address, env, "--steps", "2")
    before = _offline_run(out)
    _train(out, ray_address, env, "--steps", "3", "--resume")
    return out, before, _offline_run(out)


def test_the_wandb_run_holds_the_metrics_and_the_config(wandb_run):
    out, (run, config, history, _), _ = wandb_run
    assert run.project == "molt-test" and run.display_name == out.name  # WANDB_PROJECT; named after RUN_DIR
    assert run.run_id == (out / "wandb_id").read_text().strip()
    logged = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2):
        for key in ("reward/mean", "loss", "time/step"):
            assert history[step][key] == pytest.approx(logged[step][key]), (step, key)
    assert config["rollout"]["group_size"] == 4 and config["rollout"]["groups_per_step"] == 2
    assert config["log"]["wandb"] is True and config["env"] == "digit"
    assert config["actor"]["lora"]["rank"] == 0  # sections nest to the leaves, as in config.yaml


def test_the_wandb_run_holds_a_table_of_episodes_per_step(wandb_run):
    _, (_, _, history, (files,)), _ = wandb_run
    for step in (1, 2):
        table = json.loads((files / history[step]["episodes"]["path"]).read_text())
        assert table["columns"] == ["step", "prompt", "reply", "reward"]
        assert len(table["data"]) == 4  # --log.wandb_episodes' default, of the step's 8
        for row_step, prompt, reply, reward in table["data"]:
            assert row_step == step and prompt.startswith("[user] Repeat the digit "), prompt
            assert reply.startswith("[assistant] "), reply
            digit = prompt.removeprefix("[user] Repeat the digit ")[0]  # the digit task's reward, from the row
            assert reward == float(reply.removeprefix("[assistant] ").strip()[:1] == digit), (prompt, reply)


def test_a_resumed_run_continues_the_same_wandb_run(wandb_run):
    out, (before, _, _, _), (after, config, history, files) = wandb_run
    assert after.run_id == before.run_id and len(files) == 2  # a second offline folder of the same W&B run
    assert config["steps"] == 3 and config["resume"] is True  # the resumed run's config updates the first's
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["step"] == 3 and history[3]["reward/mean"] == pytest.approx(logged["reward/mean"])
    assert "episodes" in history[3]


def test_wandb_without_the_package_is_refused_before_any_work(tmp_path):
    # The CI environment has wandb (the test extra); hiding it from the import system is the one way to check
    # the refusal there. `sys.modules["wandb"] = None` makes `import wandb` fail and find_spec answer None.
    hidden = "import sys; sys.modules['wandb'] = None; from molt_train.cli import main; main()"
    result = subprocess.run([sys.executable, "-c", hidden, "--out", str(tmp_path / "x"), "--log.wandb", "true"],
                            capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    assert result.returncode != 0
    assert "--log.wandb: the wandb package is not installed here (pip install 'molt[wandb]')" in result.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_the_table_takes_one_episode_of_each_group_in_turn(tmp_path, monkeypatch):
    # A real offline W&B run in this process, fed hand-made groups: which episodes the table shows.
    from molt_env.trajectory import Trajectory
    from molt_train.group import Group
    from molt_train.config import Config, LogConfig
    from molt_train.metrics import Metrics

    for key, value in _env(tmp_path).items():
        if key.startswith("WANDB_"):
            monkeypatch.setenv(key, value)

    def episode(prompt, reply, reward, segments=1):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
        return [Trajectory([1, 2], [None, -0.1], [0, 1], [-1, 0], reward=reward, rollout_id=f"{prompt}-{reply}",
                           segment=i, num_segments=segments, messages=messages) for i in range(segments)]

    groups = [Group(0, episode("a", "1", 1.0, segments=2) + episode("a", "2", 0.0), []),
              Group(1, episode("b", "4", 0.25), []),
              Group(2, [Trajectory([1], [None], [0], [-1], rollout_id="raw")], [])]  # no chat: left out
    metrics = Metrics(tmp_path, Config(log=LogConfig(tensorboard=False, wandb=True, wandb_episodes=3)))
    metrics.episodes(1, groups)
    metrics.close()
    # finish() returns before W&B's service process has written the run's last records (a loaded CI machine
    # read the file without step 1); teardown stops the service, which closes the file. A molt-train process
    # does this as it exits.
    import wandb

    wandb.teardown()
    _, _, history, (files,) = _offline_run(tmp_path)
    table = json.loads((files / history[1]["episodes"]["path"]).read_text())
    assert table["data"] == [[1, "[user] a", "[assistant] 1", 1.0], [1, "[user] b", "[assistant] 4", 0.25],
                             [1, "[user] a", "[assistant] 2", 0.0]]


def test_the_table_renders_tool_calls_and_images_as_text():
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": [{"type": "text", "text": "What is in "},
                                             {"type": "image_url", "image_url": {"url": "data:..."}}]},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "a", "type": "function",
                                 "function": {"name": "look", "arguments": '{"zoom": 2}'}}]},
                {"role": "tool", "tool_call_id": "a", "content": "a cat"},
                {"role": "assistant", "content": "A cat."}]
    prompt, reply = prompt_and_reply(messages)
    assert prompt == "[system] Use the tools.\n\n[user] What is in [image]"
    assert reply == '[assistant] look({"zoom": 2})\n\n[tool] a cat\n\n[assistant] A cat.'
    assert prompt_and_reply([{"role": "user", "content": "Hi"}]) == ("[user] Hi", "")
