"""`molt-train` as a user runs it, and the README quick start that CI runs."""

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
    for flag in ["--config", "--env", "--model", "--seed", "--engine.name", "--engine.dtype",
                 "--engine.max_model_len", "--rollout.temperature", "--rollout.top_p", "--rollout.max_tokens"]:
        assert flag in out, flag
    assert "Engine weight dtype" in out  # field docstrings are the help text


def test_bad_flag_value_fails_before_work_and_names_the_flag():
    result = subprocess.run(MOLT_TRAIN + ["--engine.dtype", "fp7"], capture_output=True, text=True)
    assert result.returncode != 0
    assert "engine.dtype" in result.stderr and "fp7" in result.stderr


def test_recipe_and_overrides_resolve():
    out = subprocess.run(MOLT_TRAIN + ["--config", str(ROOT / "recipes/cpu-tiny.yaml"),
                                       "--rollout.max_tokens", "5", "--print_config"],
                         capture_output=True, text=True, check=True).stdout
    assert "max_tokens: 5" in out and "dtype: float32" in out


def test_molt_train_samples_with_per_token_logprobs():
    """The quick start's main job: tiny model into vLLM, one episode, its sampled tokens and logprobs."""
    result = subprocess.run(MOLT_TRAIN + ["--rollout.max_tokens", "6"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(-?\d+\.\d+)\s+(\d+)\s+'", result.stdout, re.M)
    assert len(rows) == 6, result.stdout
    assert all(float(logprob) <= 0 for _, _, logprob, _ in rows)
    assert "# resolved config" in result.stdout and "episode of 'arithmetic'" in result.stdout


def test_molt_train_takes_an_env_from_a_file(tmp_path):
    path = tmp_path / "task.py"
    path.write_text("from molt_env import Env\n"
                    "class Task(Env):\n"
                    "    def reset(self, *, seed=None, options=None):\n"
                    "        super().reset(seed=seed)\n"
                    "        return 'Say hi.', {}\n"
                    "    def step(self, action):\n"
                    "        return '', 0.25, True, False, {}\n")
    result = subprocess.run(MOLT_TRAIN + ["--env", f"{path}:Task", "--rollout.max_tokens", "3",
                                          "--engine.name", "hf"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reward 0.25" in result.stdout
