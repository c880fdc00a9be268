"""`molt-train` as a user runs it, and the README quick start that CI runs."""

import json
import re
import subprocess
import sys
from pathlib import Path

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
                 "--algo.is_level", "--algo.is_mode", "--actor.world_size", "--actor.backend", "--ray.address"]:
        assert flag in out, flag
    assert "Engine weight dtype" in out  # field docstrings are the help text


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
