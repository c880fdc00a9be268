"""The cluster launchers in recipes/cluster/ start a molt-train that exists.

Neither Kubernetes nor Slurm runs here, so this checks what would otherwise fail only once a cluster
is up: the KubeRay manifest's shape, the batch script's syntax, and every `molt-train` command in them
(each of its flags is one of molt-train's, its recipe exists and parses with the other flags).
"""

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from molt_train.cli import build_parser, parse_config

ROOT = Path(__file__).resolve().parents[1]
RAYJOB = ROOT / "recipes/cluster/rayjob.yaml"
SBATCH = ROOT / "recipes/cluster/molt.sbatch"
SHELL_OPERATORS = {";", "&", "&&", "||", "|", ")"}


def accepted_flags(parser) -> set[str]:
    """Every option string the parser takes, also those of nested parsers (subcommands)."""
    flags = set()
    for action in parser._actions:
        flags.update(action.option_strings)
        if isinstance(action.choices, dict):
            for nested in action.choices.values():
                if hasattr(nested, "_actions"):
                    flags |= accepted_flags(nested)
    return flags


def molt_train_commands(shell: str, defaults: dict[str, str] | None = None) -> list[list[str]]:
    """The arguments of each `molt-train` command in shell text (comments skipped), with `$NAME` replaced
    by `defaults[NAME]` where the script gives one."""
    commands = []
    for line in shell.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("#") or not re.search(r"(^|\s)molt-train\s", line):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        argv = None  # the arguments of the molt-train command being read, if any
        for token in lexer:
            if token == "molt-train":
                argv = []
                commands.append(argv)
            elif token in SHELL_OPERATORS:
                argv = None
            elif argv is not None:
                argv.append(re.sub(r"\$\{?(\w+)\}?", lambda m: (defaults or {}).get(m[1], m[0]), token))
    return commands


def script_defaults(script: str) -> dict[str, str]:
    """`NAME=${NAME:-default}` lines: what a variable the environment may override is when it does not."""
    return dict(re.findall(r"^(\w+)=\$\{\1:-(.*)\}$", script, re.MULTILINE))


def yaml_strings(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from yaml_strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from yaml_strings(value)
    elif isinstance(node, str):
        yield node


def test_rayjob_is_a_kuberay_job_with_a_head_and_gpu_workers():
    job = yaml.safe_load(RAYJOB.read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    assert spec["entrypoint"].split()[0] == "molt-train"
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert cluster["workerGroupSpecs"], "no worker group"
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert group["replicas"] >= 1
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8, group["groupName"]
        shm = {v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}
        assert any(m["mountPath"] == "/dev/shm" and m["name"] in shm for m in pod["containers"][0]["volumeMounts"])


def test_sbatch_script_is_bash():
    check = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def _launcher_commands(path: Path) -> list[list[str]]:
    text = path.read_text()
    if path.suffix == ".yaml":
        return [argv for string in yaml_strings(yaml.safe_load(text)) for argv in molt_train_commands(string)]
    return molt_train_commands(text, script_defaults(text))


@pytest.mark.parametrize("launcher", [RAYJOB, SBATCH], ids=lambda path: path.name)
def test_launcher_runs_molt_train_with_its_own_flags_and_a_recipe_that_parses(launcher):
    commands = _launcher_commands(launcher)
    assert commands, f"{launcher.name} runs no molt-train command"
    flags = accepted_flags(build_parser())
    for argv in commands:
        unknown = [arg for arg in argv if arg.startswith("--") and arg.split("=")[0] not in flags]
        assert not unknown, f"{launcher.name}: molt-train does not take {unknown} (molt-train --help)"
        assert "--config" in argv, f"{launcher.name}: molt-train {' '.join(argv)} names no recipe"
        at = argv.index("--config")
        recipe, others = argv[at + 1], argv[:at] + argv[at + 2:]
        assert (ROOT / recipe).is_file(), f"{launcher.name}: --config {recipe} is not a file in the repository"
        parse_config(["--config", str(ROOT / recipe), *others])
