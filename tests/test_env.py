"""The Gymnasium side: `Env` subclasses pass `check_env`, names resolve, bad trajectories are named."""

import math
import subprocess
import sys

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import environments
import environments.arithmetic
import molt_env
from molt_env import Env, InvalidTrajectory, Trajectory, check, validate


class Echo(Env):
    """Written as the `Env` docstring shows a user to write one."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.word = str(self.np_random.choice(["cat", "dog", "owl"]))
        return f"Say {self.word}.", {}

    def step(self, action):
        return "", float(self.word in action), True, False, {}


class Chatty(Env):
    """Chat-message observations, several turns."""

    tools = [{"type": "function", "function": {"name": "noop", "parameters": {}}}]

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turn = 0
        return [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"}], {}

    def step(self, action):
        self.turn += 1
        return [{"role": "user", "content": f"turn {self.turn}"}], 0.5, self.turn >= 3, False, {}


@pytest.mark.parametrize("env", [Echo(), Chatty(), environments.arithmetic.Arithmetic()])
def test_check_env_passes(env):
    check_env(env, skip_render_check=True)


def test_the_bundled_names_resolve_without_importing_their_package():
    """The `molt.environments` entry point: a process that imports only molt_env finds `digit` by name."""
    code = ("import sys, molt_env; assert 'environments' not in sys.modules; "
            "print(type(molt_env.make('digit')).__module__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "environments.digit", result.stderr[-2000:]


def test_gymnasium_make_and_molt_names():
    assert environments.DEFAULT_ENV in molt_env.registered()
    env = gymnasium.make("molt/Arithmetic-v0")
    observation, info = env.reset(seed=3)
    assert "What is" in observation and isinstance(info["answer"], int)
    assert isinstance(molt_env.make("arithmetic"), environments.arithmetic.Arithmetic)
    assert isinstance(molt_env.make("molt/Arithmetic-v0"), environments.arithmetic.Arithmetic)
    assert molt_env.make("environments.arithmetic:Arithmetic", max_operand=3).max_operand == 3


def test_make_from_a_file_path(tmp_path):
    path = tmp_path / "mytask.py"
    path.write_text("from molt_env import Env\n"
                    "class MyTask(Env):\n"
                    "    def reset(self, *, seed=None, options=None):\n"
                    "        super().reset(seed=seed)\n"
                    "        return 'q', {}\n"
                    "    def step(self, action):\n"
                    "        return '', 1.0, True, False, {}\n")
    env = molt_env.make(f"{path}:MyTask")
    assert env.reset(seed=0) == ("q", {})
    check_env(env, skip_render_check=True)


def test_unknown_names_say_what_is_known():
    with pytest.raises(ValueError, match="arithmetic"):
        molt_env.make("no_such_env")
    with pytest.raises(ValueError, match="no file"):
        molt_env.make("missing/file.py:Task")
    with pytest.raises(ValueError, match="no attribute"):
        molt_env.make("environments.arithmetic:Nope")


def test_arithmetic_reward():
    env = environments.arithmetic.Arithmetic()
    _, info = env.reset(seed=0)
    answer = info["answer"]
    assert env.step(f"The answer is {answer}.")[1] == 1.0
    env.reset(seed=0)
    assert env.step(f"{answer + 1}")[1] == 0.0
    env.reset(seed=0)
    assert env.step("no idea")[1] == 0.0


# --------------------------------------------------------------------------
# Trajectory


def _good(**changes):
    fields = dict(token_ids=[5, 6, 7, 8], logprobs=[None, None, -0.5, -1.25], mask=[0, 0, 1, 1],
                  versions=[-1, -1, 3, 4], reward=1.0, rollout_id="r", group_id="g")
    fields.update(changes)
    return Trajectory(**fields)


def test_valid_trajectory_round_trips_through_json():
    trajectory = _good(routes=np.arange(4 * 2 * 2, dtype=np.int16).reshape(4, 2, 2), info={"x": np.int64(3)})
    check(trajectory)
    again = Trajectory.from_json(trajectory.to_json())
    assert again.token_ids == trajectory.token_ids and again.logprobs == trajectory.logprobs
    assert np.array_equal(again.routes, trajectory.routes) and again.routes.dtype == np.int16
    assert again.info == {"x": 3}


# Two images of 2 placeholder tokens (id 9) each, then the reply.
IMAGES = dict(token_ids=[9, 9, 1, 9, 9, 2, 7, 8], logprobs=[None] * 6 + [-0.5, -1.0], mask=[0] * 6 + [1, 1],
              versions=[-1] * 6 + [0, 0])


def _mm(spans=((0, 2), (3, 2)), images=2, **tensors):
    return {"placeholder_id": 9, "spans": [list(s) for s in spans],
            "tensors": {"pixel_values": np.arange(images * 3 * 2 * 2, dtype=np.float32).reshape(images, 3, 2, 2),
                        **tensors}}


def test_image_trajectory_round_trips_with_its_tensors():
    grid = {"pixel_values": np.ones((8, 6), np.float32), "image_grid_thw": np.array([[1, 2, 2], [1, 2, 2]])}
    tiles = {"pixel_values": np.ones((1, 2, 3, 4, 4), np.float32), "pixel_attention_mask": np.ones((1, 2, 4, 4), bool)}
    idefics = {**_mm(spans=((0, 3), (3, 3))), "tensors": tiles}  # spans with the markers around the placeholders
    # LLaVA-style, Qwen-VL-style patches with a grid, Idefics3-style tiles
    for mm in (_mm(), {**_mm(), "tensors": grid}, idefics):
        trajectory = _good(**IMAGES, mm=mm)
        check(trajectory)
        again = Trajectory.from_json(trajectory.to_json())
        assert again.mm["spans"] == mm["spans"] and again.mm["placeholder_id"] == 9
        for name, tensor in mm["tensors"].items():
            assert again.mm["tensors"][name].dtype == tensor.dtype and np.array_equal(again.mm["tensors"][name], tensor)


@pytest.mark.parametrize("mm,needle", [
    (_mm(spans=((0, 2),), images=1), "placeholder tokens outside the spans"),
    (_mm(spans=((0, 2), (2, 1))), "holds no placeholder"),
    (_mm(spans=((0, 2), (7, 2))), "outside the 8 tokens"),
    (_mm(spans=((0, 4), (3, 2))), "overlaps the one before"),
    (_mm(images=3), "2 placeholder spans for 3 images"),
    ({**_mm(), "tensors": {"pixel_values": np.ones((7, 6), np.float32),
                           "image_grid_thw": np.array([[1, 2, 2], [1, 2, 2]])}}, "covers 8 patches"),
    ({**_mm(), "tensors": {"pixel_values": np.ones((1, 1, 3, 4, 4), np.float32)}}, "for pixel_values of shape"),
    ({"spans": []}, "needs placeholder_id"),
])
def test_validator_checks_images_against_their_placeholders(mm, needle):
    trajectory = _good(**IMAGES, mm=mm)
    assert validate(trajectory) == "mm_mismatch"
    with pytest.raises(InvalidTrajectory, match=needle):
        check(trajectory)


@pytest.mark.parametrize("changes,reason", [
    (dict(token_ids=[], logprobs=[], mask=[], versions=[]), "empty"),
    (dict(mask=[0, 0, 1]), "length_mismatch"),
    (dict(token_ids=[5, -6, 7, 8]), "bad_token_id"),
    (dict(mask=[0, 0, 2, 1]), "bad_mask"),
    (dict(mask=[0, 0, 0, 0]), "no_trainable_tokens"),
    (dict(mask=[1, 0, 1, 1], logprobs=[-1.0, None, -0.5, -1.0], versions=[0, -1, 3, 4]), "first_token_trainable"),
    (dict(logprobs=[None, None, None, -1.0]), "trainable_without_logprob"),
    (dict(logprobs=[None, None, math.nan, -1.0]), "trainable_without_logprob"),
    (dict(logprobs=[None, None, 0.5, -1.0]), "trainable_without_logprob"),
    (dict(versions=[-1, -1, -1, 4]), "trainable_without_version"),
    (dict(routes=np.zeros((3, 2, 2), dtype=np.int16)), "routes_mismatch"),
    (dict(routes=np.zeros((4, 2, 2), dtype=np.int64)), "routes_mismatch"),
    (dict(reward=math.inf), "bad_reward"),
])
def test_validator_names_what_is_wrong(changes, reason):
    trajectory = _good(**changes)
    assert validate(trajectory) == reason
    with pytest.raises(InvalidTrajectory) as error:
        check(trajectory)
    assert error.value.reason == reason



def test_quick_env_calls_move_onto_the_event_loop_and_slow_ones_back_to_threads_for_a_while(monkeypatch):
    import asyncio
    import threading
    import time

    import molt_env.env as env_module

    # thresholds far from the calls' own times, so a loaded machine's preemption cannot move a call across them
    monkeypatch.setattr(env_module, "QUICK_SECONDS", 0.05)
    monkeypatch.setattr(env_module, "SLOW_SECONDS", 0.05)
    monkeypatch.setattr(env_module, "INLINE_AFTER", 8)

    class Timed(Env):
        delay = 0.0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.threads = []
            return "go", {}

        def step(self, action):
            self.threads.append(threading.get_ident())
            time.sleep(self.delay)
            return "", 0.0, True, False, {}

    class Slow(Timed):
        delay = 0.1

    async def play(env, calls):
        for _ in range(calls):
            await env.astep("x")
        return threading.get_ident()

    quick, slow = Timed(), Slow()
    for env in (quick, slow):
        env.reset(seed=0)
    loop_thread = asyncio.run(play(quick, env_module.INLINE_AFTER + 3))
    # the first INLINE_AFTER calls in threads, then on the loop
    assert all(t != loop_thread for t in quick.threads[:env_module.INLINE_AFTER])
    assert quick.threads[env_module.INLINE_AFTER:] == [loop_thread] * 3
    loop_thread = asyncio.run(play(slow, env_module.INLINE_AFTER + 3))
    assert loop_thread not in slow.threads  # every call over QUICK_SECONDS: never on the loop
    Timed.delay = 2 * env_module.SLOW_SECONDS  # a quick class turns slow: one call on the loop, then threads
    quick.threads = []
    loop_thread = asyncio.run(play(quick, 3))
    assert quick.threads[0] == loop_thread and loop_thread not in quick.threads[1:]
    # quick again (the slow call was the machine's, say): back on the loop after twice as many quick calls
    Timed.delay = 0.0
    quick.threads = []
    loop_thread = asyncio.run(play(quick, 2 * env_module.INLINE_AFTER + 2))
    assert loop_thread not in quick.threads[:2 * env_module.INLINE_AFTER]
    assert quick.threads[2 * env_module.INLINE_AFTER:] == [loop_thread] * 2
