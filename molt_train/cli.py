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

from molt_train.config import Config, ConfigError, validate

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


def _bare_booleans(argv: list[str]) -> list[str]:
    """`--resume` alone means `--resume true`, for every boolean flag."""
    flags, out = _bool_flags(), []
    for i, arg in enumerate(argv):
        out.append(arg)
        following = argv[i + 1].lower() if i + 1 < len(argv) else ""
        if arg in flags and following not in ("true", "false", "yes", "no", "1", "0"):
            out.append("true")
    return out


def parse_config(argv: list[str] | None = None) -> tuple[Config, str]:
    """The validated `Config` and its YAML dump (what the run directory keeps)."""
    parser = build_parser()
    namespace = parser.parse_args(_bare_booleans(list(sys.argv[1:] if argv is None else argv)))
    namespace.pop("config", None)
    config = parser.instantiate(namespace)
    return Config(**{k: v for k, v in vars(config).items()}), parser.dump(namespace)


def _model_dir(config: Config) -> str:
    from molt_agents.tiny import tiny_model

    if config.model is None:
        return str(tiny_model("chat"))
    if config.model.startswith("tiny:"):  # tiny:dense, tiny:moe, tiny:chat, tiny:vlm
        return str(tiny_model(config.model.split(":", 1)[1]))
    return config.model


def main(argv: list[str] | None = None) -> None:
    config, resolved = parse_config(sys.argv[1:] if argv is None else argv)
    try:
        validate(config)
        import environments  # noqa: F401  (registers the bundled environments' short names)
        import molt_env

        molt_env.make(config.env)  # fail now, not inside a worker, on a bad --env or --agent
        if config.agent is not None:
            from molt_env.registry import load_class

            load_class(config.agent)
    except (ConfigError, ValueError) as error:
        sys.exit(f"molt-train: {error}")
    model_dir = _model_dir(config)
    from molt_agents.multimodal import Vision

    if Vision.available(model_dir) and config.engine.name == "vllm":  # vision modules may need torchvision
        from molt_agents.engines.vllm_engine import unloadable

        problem = unloadable(model_dir)
        if problem:
            sys.exit(f"molt-train: --model {config.model}: {problem}; pass --engine.name hf")
    run_dir = Path(config.out or f"runs/{Path(config.env.split(':')[-1]).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_dir.exists() and not config.resume and any(run_dir.glob("checkpoints/step_*")):
        sys.exit(f"molt-train: {run_dir} already holds a run; pass --resume to continue it or a new --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(resolved)
    print("# resolved config\n" + resolved + f"# model: {model_dir}\n# run directory: {run_dir}", flush=True)

    from molt_train.loop import run

    run(config, run_dir, model_dir)


if __name__ == "__main__":
    main()
