"""`molt-train`: parse and validate the config tree, set up the run directory, run the loop.

`molt-train` alone trains the built-in tiny chat model on the default
environment on this machine's CPU; every flag is in `molt-train --help`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from molt_train import resume
from molt_train.config import Config, ConfigError, validate
from molt_train.console import LOG, Console
from molt_train.model_fit import resolve_from_model

set_parsing_settings(docstring_parse_attribute_docstrings=True)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="molt-train",
        description="Train an LLM agent on a Molt environment with asynchronous RL.",
        default_env=False,
    )
    parser.add_argument("--config", action=ActionConfigFile,
                        help="YAML recipe (see recipes/); flags after it override it.")
    parser.add_class_arguments(Config, nested_key=None, as_group=False)
    return parser


def _bool_flags(cls=Config, prefix: str = "") -> set[str]:
    flags = set()
    for f in dataclasses.fields(cls):
        if f.type == "bool":
            flags.add(f"--{prefix}{f.name}")
        elif dataclasses.is_dataclass(f.default_factory if callable(f.default_factory) else None):
            flags |= _bool_flags(f.default_factory, f"{prefix}{f.name}.")
    return flags


def _bare_booleans(argv: list[str], cls=Config) -> list[str]:
    """`--resume` alone means `--resume true`, for every boolean flag of `cls` (a config dataclass)."""
    flags, out = _bool_flags(cls), []
    for i, arg in enumerate(argv):
        out.append(arg)
        following = argv[i + 1].lower() if i + 1 < len(argv) else ""
        if arg in flags and following not in ("true", "false", "yes", "no", "1", "0"):
            out.append("true")
    return out


def parse_config(argv: list[str] | None = None) -> tuple[Config, dict]:
    """The `Config`, and what a resume changes (`{flag: [before, now]}`).

    With `--resume`, the run's own `RUN_DIR/config.yaml` (plus the changes earlier resumes recorded in
    `RUN_DIR/config_history.jsonl`) is the starting point and only the flags given now apply on top;
    a flag that changes what the run is fails, naming it.
    """
    argv = _bare_booleans(["--dry_run" if arg == "--dry-run" else arg for arg in (sys.argv[1:] if argv is None else argv)])
    parser = build_parser()
    namespace = parser.parse_args([a for a in argv if not a.startswith("--print_config")])  # it would exit here
    changes: dict = {}
    if namespace.resume and namespace.out is not None:
        run_dir = Path(namespace.out)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume: {run_dir / 'config.yaml'} does not exist: is {run_dir} a molt-train "
                              "run directory?")
        before = resume.run_config(parser, run_dir)
        parser.set_defaults(before)
        namespace = parser.parse_args(argv)
        changes = resume.changes(before, dict(namespace.items()))
    elif any(a.startswith("--print_config") for a in argv):
        parser.parse_args(argv)
    namespace.pop("config", None)
    config = parser.instantiate(namespace)
    return Config(**vars(config)), changes


def dump(config: Config) -> str:
    """The config as the YAML recipe `--config` reads back."""
    parser = build_parser()
    return parser.dump(parser.parse_object(dataclasses.asdict(config)))


def main(argv: list[str] | None = None) -> None:
    from molt_agents.tiny import model_dir as named_model_dir

    try:
        config, changes = parse_config(sys.argv[1:] if argv is None else argv)
        validate(config)
        check_loadable(config)
        model_dir = str(named_model_dir(config.model))
        reward_dir = None
        if config.reward.model:
            try:
                reward_dir = str(named_model_dir(config.reward.model, default="reward"))
            except ValueError as error:
                raise ConfigError(f"--reward.{str(error).removeprefix('--')}") from None
        if config.dry_run:
            sys.exit(dry_run(config, model_dir, reward_dir))
        resolve_from_model(config, model_dir)
    except (ConfigError, ValueError) as error:
        sys.exit(f"molt-train: {error}")
    run_dir = Path(config.out or f"runs/{Path(config.env.split(':')[-1]).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_dir.exists() and not config.resume and any(run_dir.glob("checkpoints/step_*")):
        sys.exit(f"molt-train: {run_dir} already holds a run; pass --resume to continue it or a new --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    if config.resume:
        from molt_train import checkpoint

        latest = checkpoint.latest(run_dir)
        resume.record(run_dir, changes, checkpoint.load_state(latest)["step"] if latest else 0)
    else:
        (run_dir / "config.yaml").write_text(dump(config))
    console = Console(run_dir, config.log.verbose)
    console.say(summary(config, run_dir, model_dir))
    for flag, (before, now) in changes.items():
        console.say(f"# resumed with --{flag} {now} (was {before})")

    from molt_train.loop import RunFailed, run
    from molt_train.stop import Stopped

    console.startup.mark("command")

    try:
        run(config, run_dir, model_dir, console)
    except Stopped as stopped:
        console.say(f"molt-train: {stopped}; continue with --out {run_dir} --resume")
        sys.exit(stopped.exit_code)
    except RunFailed as error:  # the failure's traceback was shown when it first happened
        console.say(f"molt-train: {error}")
        sys.exit(1)
    except KeyboardInterrupt:
        console.say(f"molt-train: interrupted; continue with --out {run_dir} --resume")
        sys.exit(130)
    except Exception as error:  # one line here, the traceback in the run's log
        console.say(console.failed(error))
        console.say(f"continue from the last checkpoint with --out {run_dir} --resume")
        sys.exit(1)


def check_loadable(config: Config) -> None:
    """The environment and the agent load: a bad --env or --agent fails now, not inside a worker."""
    import molt_env
    from molt_env.registry import load_class

    try:
        molt_env.make(config.env)
    except ValueError as error:
        raise ConfigError(f"--env {config.env}: {error}") from None
    if config.agent is not None:
        try:
            load_class(config.agent)
        except ValueError as error:
            raise ConfigError(f"--agent {config.agent}: {error}") from None


def dry_run(config: Config, model_dir: str, reward_dir: str | None = None) -> int:
    """Print the run's plan (`reward_dir`: the reward model's directory, with --reward.model); 0 if it fits,
    else the error naming the flag to change (exit status 1)."""
    from molt_train import plan
    from molt_train.model_fit import model_config

    try:
        cluster = plan.cluster_of(config)
        resolve_from_model(config, model_dir, local=False)
        the_plan = plan.make_plan(config, model_config(model_dir), cluster,
                                  model_config(reward_dir) if reward_dir else None)
        print(plan.render(the_plan, model_dir))
        plan.check(the_plan)
    except ConfigError as error:
        return f"molt-train --dry-run: {error}"
    print("molt-train --dry-run: the run fits")
    return 0


def summary(config: Config, run_dir: Path, model_dir: str) -> str:
    """The resolved config, one line per group (the whole of it is in RUN_DIR/config.yaml)."""
    def fields(obj):
        return " ".join(f"{f.name}={getattr(obj, f.name)}" for f in dataclasses.fields(obj)
                        if not dataclasses.is_dataclass(getattr(obj, f.name)))

    groups = [f"#   {f.name}: {fields(getattr(config, f.name))}" for f in dataclasses.fields(config)
              if dataclasses.is_dataclass(getattr(config, f.name))]
    return "\n".join([f"# run {run_dir} ({run_dir / 'config.yaml'}, output of every process in "
                      f"{run_dir / LOG} unless --log.verbose)", f"# model {model_dir}", f"# {fields(config)}",
                      *groups])


if __name__ == "__main__":
    main()
