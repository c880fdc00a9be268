"""Runs that lose something and go on: a resumed run is the run's own, a dead worker is replaced, and
what cannot go on says so in one line.

Each run is the real `molt-train` in a subprocess joined to this test session's Ray; processes are
killed with SIGKILL, as the kernel's OOM killer or a crashed node would.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

MOLT_TRAIN = [sys.executable, "-m", "molt_train.cli"]
SMALL = ["--log.tensorboard", "false", "--rollout.groups_per_step", "4", "--rollout.group_size", "4"]


def _start(out, ray_address, *flags, started=None):
    args = MOLT_TRAIN + ["--out", str(out), "--ray.address", ray_address, *SMALL, *flags]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    if started is not None:
        started.append(process)
    return process


def _train(out, ray_address, *flags, expect=0):
    process = _start(out, ray_address, *flags)
    stdout, _ = process.communicate(timeout=600)
    assert process.returncode == expect, stdout[-4000:]
    return stdout


def _metrics(out):
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait_for(process, condition, what, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: {process.stdout.read()[-3000:]}"
        assert time.time() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.2)


def _actor(class_name):
    """The one live Ray actor of `class_name` in this session's cluster: its pid and restart count.
    (Ray's public state API needs the dashboard, which the tests run without; this reads the GCS table.)"""
    from ray._private.state import actors

    (actor,) = [a for a in actors().values() if a["ActorClassName"] == class_name and a["State"] == "ALIVE"]
    return actor


@pytest.fixture
def started():
    """Runs a test started; any still running when it ends (a failed assertion) are killed."""
    processes = []
    yield processes
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _slow_digit(tmp_path, seconds: float) -> str:
    """The digit task with every env step taking `seconds`: a run whose steps take long enough to act on."""
    env = tmp_path / "slow.py"
    env.write_text("import time\n"
                   "from environments.digit import Digit\n"
                   "class Slow(Digit):\n"
                   "    def step(self, action):\n"
                   f"        time.sleep({seconds})\n"
                   "        return super().step(action)\n")
    return f"{env}:Slow"


def _whole_then_cut(tmp_path, ray_address, started, seconds: float, *flags):
    """A synchronous run of 5 steps of the slowed digit task, whole; then the same run started again and at
    its step 2: (the whole run's metrics, the second run's directory, its process)."""
    flags = ["--env", _slow_digit(tmp_path, seconds), "--steps", "5", "--train.async_queue_size", "0", *flags]
    _train(tmp_path / "whole", ray_address, *flags)
    out = tmp_path / "cut"
    process = _start(out, ray_address, *flags, started=started)
    _wait_for(process, lambda: len(_metrics(out)) >= 2, "step 2")
    return _metrics(tmp_path / "whole"), out, process


def _resume_equals(out, ray_address, whole, since: int) -> None:
    """Resume the run in `out`: it logs steps 1-5 once each, and from step `since` + 1 on each step equals
    the whole run's (the same data and rewards; the same losses within float noise)."""
    _train(out, ray_address, "--resume")
    resumed = _metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, 6))  # no step lost, none logged twice
    for a, b in zip(whole[since:], resumed[since:]):
        for key in ["data/groups", "reward/mean", "tokens/trained", "response_len/mean", "version"]:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        for key in ["loss", "kl", "grad_norm", "mismatch/kl"]:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])


def test_a_killed_run_resumes_with_its_own_config(tmp_path, ray_address, started):
    out = tmp_path / "run"
    # Episodes of 0.3 s: the run is still going when it is killed after step 3 (the plain task's 8 steps
    # can all be done before a poll sees step 3).
    process = _start(out, ray_address, "--env", _slow_digit(tmp_path, 0.3), "--seed", "2", "--steps", "8",
                     "--ckpt.every", "2", started=started)
    _wait_for(process, lambda: len(_metrics(out)) >= 3 and (out / "checkpoints/step_000002").exists(), "step 3")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    config = (out / "config.yaml").read_text()
    before = _metrics(out)
    checkpoint = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    assert checkpoint < 8  # killed mid-run: the resume has steps to take

    refused = _train(out, ray_address, "--resume", "--seed", "3", expect=1)
    assert "--seed 2 -> 3 would change what the run is" in refused
    stdout = _train(out, ray_address, "--resume", "--steps", "9")
    assert "seed=2" in stdout and "steps=9" in stdout and "# resumed with --steps 9 (was 8)" in stdout
    # Quiet: one screen apart from the progress bar; the third-party notices are in the run's log.
    shown = [line for line in stdout.splitlines() if line.strip() and "%|" not in line]
    assert len(shown) <= 24 and not [line for line in shown if "WARNING" in line or "Warning" in line], shown
    assert "WARNING" in (out / "molt.log").read_text()
    assert (out / "config.yaml").read_text() == config  # the run's own config, never overwritten
    (change,) = [json.loads(line) for line in (out / "config_history.jsonl").read_text().splitlines()]
    assert change["changes"] == {"steps": [8, 9]} and change["from_step"] == checkpoint
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 10))  # continued to 9, nothing logged twice
    trained_before = {g for r in before if r["step"] <= checkpoint for g in r["data/groups"]}
    trained_after = [g for r in rows if r["step"] > checkpoint for g in r["data/groups"]]
    assert not set(trained_after) & trained_before and len(trained_after) == (9 - checkpoint) * 4


def test_a_run_that_loses_a_worker_then_its_trainer_resumes_into_the_uninterrupted_run(tmp_path, ray_address,
                                                                                         started):
    """One run, two deaths. A killed rollout worker is replaced and the run goes on: its groups in flight are
    played again, on the trainer's weights and version. A killed trainer rank then ends the run in one line.
    The resumed run loses no step and, step by step, equals the same run never interrupted."""
    # The digit task, its episodes taking a second, so the worker is playing the next step's groups when it
    # is killed.
    whole, out, process = _whole_then_cut(tmp_path, ray_address, started, 1.0, "--seed", "1", "--ckpt.every", "2")
    os.kill(_actor("RolloutWorker")["Pid"], signal.SIGKILL)
    _wait_for(process, lambda: len(_metrics(out)) >= 3, "step 3")
    os.kill(_actor("PolicyRank")["Pid"], signal.SIGKILL)
    stdout, _ = process.communicate(timeout=300)
    assert process.returncode == 1, stdout[-3000:]
    cut = _metrics(out)
    assert [r["step"] for r in cut] == [1, 2, 3]  # the run went on after the worker's death
    assert sum(r["rollouts/lost_groups"] for r in cut) >= 1
    assert all(len(r["data/groups"]) == 4 for r in cut)  # the lost groups were played again
    # The restarted worker samples with the trainer's weights and the right version.
    assert all(r["mismatch/max_abs"] is None or r["mismatch/max_abs"] < 1e-4 for r in cut)
    assert [r["version"] for r in cut] == [1, 2, 3]
    assert "rollout worker(s) died and Ray restarted them" in stdout
    failure = [line for line in stdout.splitlines() if line.startswith("molt-train: ") and "%|" not in line]
    assert len(failure) == 1 and "a trainer rank's process died" in failure[0], stdout[-3000:]
    assert f"traceback in {out / 'molt.log'}" in failure[0]
    assert "Traceback" not in stdout and "Traceback" in (out / "molt.log").read_text()
    checkpoint = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    assert checkpoint < 3  # step 3 was logged but not saved: the resume must redo it

    _resume_equals(out, ray_address, whole, checkpoint)  # the steps after the resume


def test_an_actor_that_fails_to_start_is_one_line_naming_it(tmp_path, ray_address):
    from molt_agents.tiny import tiny_model

    model = tmp_path / "no-weights"  # a config and a tokenizer, but no weights file
    model.mkdir()
    for path in tiny_model("chat").iterdir():
        if not path.name.endswith(".safetensors"):
            (model / path.name).write_bytes(path.read_bytes())
    out = tmp_path / "broken"
    stdout = _train(out, ray_address, "--model", str(model), "--steps", "2", expect=1)
    failure = [line for line in stdout.splitlines() if line.startswith("molt-train: ")]
    assert len(failure) == 1 and "failed to start: " in failure[0] and "model.safetensors" in failure[0], stdout
    assert f"(traceback in {out / 'molt.log'})" in failure[0] and "Traceback" not in stdout
    assert "Traceback" in (out / "molt.log").read_text()


def test_a_step_of_groups_goes_to_each_worker_in_one_call_and_a_lost_call_is_played_again():
    """The stream's bookkeeping over stand-in workers (in process, no Ray: what is checked is which calls
    the stream makes, and what it redoes when one fails as a dead worker's does)."""
    import asyncio

    import ray

    from molt_train.rollout import GroupStream

    class Worker:
        def __init__(self, fail_first=False):
            self.calls, self.fail_first = [], fail_first
            self.groups = self  # `worker.groups.remote(...)`, as on a Ray actor handle

        def remote(self, chunk, size, hold=None):
            self.calls.append([index for index, _ in chunk])
            future = asyncio.get_running_loop().create_future()
            if self.fail_first and len(self.calls) == 1:
                future.set_exception(ray.exceptions.RayActorError())
            else:
                future.set_result([{"group_index": index, "seed": seed, "size": size} for index, seed in chunk])
            return future

    async def run():
        workers = [Worker(), Worker(fail_first=True)]
        stream = GroupStream(workers, group_size=8, groups_per_step=6, queue_size=0, seed=0)
        first = await stream.take()
        second = await stream.take()
        return workers, stream, first, second

    workers, stream, first, second = asyncio.run(run())
    # 6 groups a step on 2 workers: 3 each, in one call; worker 1's first call is lost and its groups redone
    assert workers[0].calls[0] == [0, 1, 2] and workers[1].calls[0] == [3, 4, 5]
    assert all(len(call) == 3 for worker in workers for call in worker.calls)
    assert sorted(g["group_index"] for g in first) == [0, 1, 2, 3, 4, 5]
    assert stream.take_lost() == 3
    assert all(g["seed"] == stream.env_seed(g["group_index"]) and g["size"] == 8 for g in first + second)
    assert sorted(g["group_index"] for g in second) == [6, 7, 8, 9, 10, 11]
    assert stream.position() == {"next_index": 12, "redo": []}


@pytest.mark.parametrize("queue_size", [0, 4])
def test_dynamic_sampling_replaces_groups_without_advantage_within_the_steps_budget(queue_size):
    """The stream's bookkeeping over a stand-in worker (as above): group i scores 1, 0, 0, ... when i is a
    multiple of 3, else all 0. Four groups a step, up to three extra; groups that finish together are taken
    in the order they were started. Synchronous: step 1 takes groups 0 and 3, sets aside 1 and 2 and starts
    4 and 5 in their place; 4 is set aside too, the budget's last, and 6 replaces it; 5 fills the step.
    Step 2 starts 7-10 and sets aside 7, 8 and 10 (its budget is three again) for 11-13, which fill the step
    with 9 whatever they score. Asynchronous (0-7 started at once, then the look-ahead): the same steps."""
    import asyncio
    from types import SimpleNamespace

    from molt_train.group import Group
    from molt_train.rollout import GroupStream

    def rewards(index):
        return [1.0, 0.0, 0.0] if index % 3 == 0 else [0.0, 0.0, 0.0]

    class Worker:
        def __init__(self):
            self.started = []
            self.groups = self

        def remote(self, chunk, size, hold=None):
            self.started += [index for index, _ in chunk]
            future = asyncio.get_running_loop().create_future()
            future.set_result([Group(index, [SimpleNamespace(reward=r) for r in rewards(index)], [])
                               for index, _ in chunk])
            return future

    async def run():
        worker = Worker()
        stream = GroupStream([worker], group_size=3, groups_per_step=4, queue_size=queue_size, seed=0, max_extra=3)
        first = await stream.take()
        replaced_first = stream.take_replaced()
        second = await stream.take()
        return worker, first, replaced_first, second, stream.take_replaced()

    worker, first, replaced_first, second, replaced_second = asyncio.run(run())
    assert [g.index for g in replaced_first] == [1, 2, 4] and [g.index for g in replaced_second] == [7, 8, 10]
    assert [g.index for g in first] == [0, 3, 5, 6] and [g.index for g in second] == [9, 11, 12, 13]
    assert len(worker.started) == len(set(worker.started))  # no group started twice
    if queue_size == 0:  # each step's groups and their replacements, nothing ahead
        assert sorted(worker.started) == list(range(14))


def test_an_agent_that_fails_every_episode_ends_the_run_in_one_line_naming_the_exception(tmp_path, ray_address):
    agent = tmp_path / "broken_agent.py"
    agent.write_text("from molt_agents.agent import ChatAgent\n"
                     "class Broken(ChatAgent):\n"
                     "    async def run(self, ctx):\n"
                     "        return ctx.task['answer']  # the task's info has no such key\n")
    out = tmp_path / "run"
    stdout = _train(out, ray_address, "--agent", f"{agent}:Broken", "--steps", "20", expect=1)
    failure = [line for line in stdout.splitlines() if line.startswith("molt-train: every episode")]
    assert failure == [f"molt-train: every episode of the last 3 steps failed (steps 1-3); the first: "
                       f"KeyError: 'answer' ({agent}:4, in run)"], stdout[-3000:]
    logged = _metrics(out)  # the steps before the third: every episode failed, nothing trained or saved
    assert [(r["step"], r["episodes/failed"], r["tokens/trained"]) for r in logged] == [(1, 16, 0), (2, 16, 0)]
    assert not (out / "checkpoints").exists()


def test_sigterm_to_the_whole_process_group_of_a_run_with_its_own_ray_saves_and_exits(tmp_path, started):
    """`timeout`, `kill -TERM -PGID` and Slurm signal every process of the group: the run's own local Ray
    (its GCS and raylet) stops with it. The run still saves its last finished step and exits 143 within 30 s,
    without waiting on the Ray it started."""
    out = tmp_path / "own-ray"
    process = subprocess.Popen(MOLT_TRAIN + ["--out", str(out), *SMALL, "--env", _slow_digit(tmp_path, 0.5),
                                             "--steps", "20", "--ckpt.every", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started.append(process)
    _wait_for(process, lambda: len(_metrics(out)) >= 2, "step 2")
    signalled = time.time()
    os.killpg(process.pid, signal.SIGTERM)
    stdout, _ = process.communicate(timeout=120)
    waited = time.time() - signalled
    print(f"exited {process.returncode} {waited:.1f} s after the group's SIGTERM")
    assert process.returncode == 143 and waited < 30, stdout[-3000:]
    (saved,) = (out / "checkpoints").glob("step_*")
    assert f"molt-train: stopped by SIGTERM after step {len(_metrics(out))}; checkpoint {saved}" in stdout


def test_a_stop_whose_signal_also_ended_a_trainer_rank_exits_143_with_its_stop_line(tmp_path, ray_address, started):
    """A signal to the whole process group can end the run's own Ray, and a trainer rank with it, before the
    run saves (a step of several seconds under `timeout` or Slurm). The run still exits 143 with its one stop
    line, naming the checkpoint to resume from, and closing the dead rank adds no error over it."""
    out = tmp_path / "rank-gone"
    process = _start(out, ray_address, "--env", _slow_digit(tmp_path, 0.5), "--steps", "20",
                     "--train.async_queue_size", "0", "--ckpt.every", "1", started=started)
    _wait_for(process, lambda: len(_metrics(out)) >= 2, "step 2")
    rank = _actor("PolicyRank")["Pid"]
    process.send_signal(signal.SIGTERM)
    os.kill(rank, signal.SIGKILL)
    stdout, _ = process.communicate(timeout=120)
    assert process.returncode == 143 and "Traceback" not in stdout, stdout[-3000:]
    stops = [line for line in stdout.splitlines() if line.startswith("molt-train: stopped by SIGTERM")]
    assert len(stops) == 1 and f"checkpoint {out / 'checkpoints'}" in stops[0], stdout[-3000:]


@pytest.mark.parametrize("lora", [[], ["--actor.lora.rank", "8", "--train.lr", "1e-2"]], ids=["full", "lora"])
def test_sigterm_saves_the_last_finished_step_and_the_resumed_run_equals_the_uninterrupted_one(
        tmp_path, ray_address, started, lora):
    """A scheduler's preemption: SIGTERM to the driver mid-run. The run saves its last finished step (no
    checkpoint is due before the end) and exits 143 at once; the resume redoes nothing and, step by step,
    equals the run never interrupted (synchronous mode: each step's rollouts come from the step before).
    Under LoRA the checkpoint holds the adapters, which the resumed trainer and engines take up."""
    whole, out, process = _whole_then_cut(tmp_path, ray_address, started, 0.5, "--seed", "4", "--ckpt.every", "0",
                                          *lora)
    signalled = time.time()
    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 143 and time.time() - signalled < 30, stdout[-3000:]
    cut = _metrics(out)
    (saved,) = (out / "checkpoints").glob("step_*")
    assert saved.name == f"step_{len(cut):06d}" and 2 <= len(cut) < 5  # the last finished step, mid-run
    assert f"molt-train: stopped by SIGTERM after step {len(cut)}; checkpoint {saved}" in stdout

    _resume_equals(out, ray_address, whole, 0)
