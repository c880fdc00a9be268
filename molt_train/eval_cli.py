"""`molt-eval`: score a run, a checkpoint, or a model behind an OpenAI-compatible endpoint, on held-out episodes.

    molt-eval --model runs/locker-X --out report.json              # a run's latest checkpoint, as it trained
    molt-eval --model runs/digit-X/checkpoints/step_000200 --eval.episodes 256
    molt-eval --model gpt-4o-mini --base-url https://api.openai.com/v1 --api-key $KEY --env digit

The flags are molt-train's, parsed by the same machinery (`--env`, `--agent`, `--seed`, `--eval.*`,
`--rollout.*`, `--engine.*`), plus the endpoint's and the report's. Given a run (its directory or one of
its checkpoints), the run's own `config.yaml` is the starting point (its environment, agent, seed,
rollout, engine and evaluation settings: the run is scored as it trained), and the flags given apply on
top. The episodes are the evaluation range of `molt_env.split` (seeds training never draws), the same ones
`molt-train --eval.*` scores during a run, so a hosted model and our checkpoint are compared on identical
episodes. A checkpoint plays them on its engine through the rollout worker's own code; with `--base-url`,
`--model` is the name the endpoint serves (`molt_agents.episode.EndpointPlayer`). The report holds every
play (reward, turns, tokens, failure) and the summary of `evaluate.summarize`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from jsonargparse import ArgumentParser

from molt_train.cli import check_loadable  # (also sets molt-train's parsing: flag help from docstrings)
from molt_train.config import Config, ConfigError, EngineConfig, EvalConfig, RolloutConfig


@dataclass
class EvalCommand:
    """Score a model on held-out episodes."""

    model: str
    """A run directory (its latest checkpoint), a checkpoint (RUN_DIR/checkpoints/step_N or its policy/), a
    Hugging Face model directory or tiny:KIND; with --base_url, the model name the endpoint serves."""
    env: str = "digit"
    """Environment, as molt-train --env (default: the run's, else digit)."""
    agent: str | None = None
    """A ChatAgent class that plays each episode (through the loopback, or against --base_url); default: the
    env runner."""
    seed: int = 0
    """Sampling seed (default: the run's)."""
    base_url: str | None = None
    """An OpenAI-compatible endpoint (e.g. molt-serve's base URL, <session> replaced per play) to evaluate
    instead of a checkpoint."""
    api_key: str = "none"
    """API key of --base_url."""
    concurrency: int = 16
    """Plays in flight against --base_url."""
    out: str | None = None
    """Write the report (JSON) here."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def config(self) -> Config:
        """The run this evaluation stands for, as molt-train's checks and engines take it."""
        return Config(env=self.env, agent=self.agent, seed=self.seed, eval=self.eval, rollout=self.rollout,
                      engine=self.engine)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="molt-eval", description=__doc__.split("\n\n")[0], default_env=False)
    parser.add_class_arguments(EvalCommand, nested_key=None, as_group=False)
    return parser


def parse(argv: list[str]) -> EvalCommand:
    """The command; for a run's model, the run's own settings are the defaults (`run_of`)."""
    argv = [_underscored(arg) for arg in argv]
    parser = build_parser()
    model = parser.parse_args(argv).model
    run_dir = None if any(arg.startswith("--base_url") for arg in argv) else run_of(Path(model))
    if run_dir is not None:
        from molt_train import resume
        from molt_train.cli import build_parser as train_parser

        known = {action.dest for action in parser._actions}
        parser.set_defaults({flag: value for flag, value in resume.run_config(train_parser(), run_dir).items()
                             if flag in known and flag not in ("model", "out")})
    namespace = parser.parse_args(argv)
    return EvalCommand(**vars(parser.instantiate(namespace)))


def _underscored(arg: str) -> str:
    """`--base-url` as `--base_url` (the spelling of the config's fields); values unchanged."""
    if not arg.startswith("--"):
        return arg
    flag, equals, value = arg.partition("=")
    return "--" + flag[2:].replace("-", "_") + equals + value


def run_of(path: Path) -> Path | None:
    """The run directory `path` belongs to: itself, or the run of a checkpoint or of its policy/."""
    if path.name in ("policy", "adapter"):
        path = path.parent
    if path.name.startswith("step_") and path.parent.name == "checkpoints":
        path = path.parent.parent
    return path if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir() else None


def main(argv: list[str] | None = None) -> None:
    try:
        command = parse(sys.argv[1:] if argv is None else argv)
        config = command.config()
        check(command, config)
        started = time.perf_counter()
        play = play_endpoint if command.base_url else play_checkpoint
        records = asyncio.run(play(command, config))
    except (ConfigError, ValueError) as error:
        sys.exit(f"molt-eval: {error}")
    from molt_train.evaluate import summarize

    summary = summarize(records, config.eval.pass_threshold) | {"seconds": time.perf_counter() - started}
    report = {"model": command.model if command.base_url else str(policy_dir(command.model)), "env": config.env,
              "agent": config.agent, "base_url": command.base_url, "seed": config.seed,
              "eval": dataclasses.asdict(config.eval), "rollout": dataclasses.asdict(config.rollout),
              "summary": summary, "plays": records}
    if command.out is not None:
        Path(command.out).parent.mkdir(parents=True, exist_ok=True)
        Path(command.out).write_text(json.dumps(report, indent=1))
    evaluation, k = config.eval, config.eval.samples
    print(f"molt-eval: {config.env}, {summary['episodes']} episodes x {k} at temperature {evaluation.temperature}: "
          f"reward {summary['reward']:.3f}, pass@1 {summary['pass@1']:.3f}"
          + (f", pass@{k} {summary[f'pass@{k}']:.3f}" if k > 1 else "")
          + f", {summary['failed']} failed, {summary['seconds']:.1f} s"
          + (f"; report {command.out}" if command.out else ""))


def check(command: EvalCommand, config: Config) -> None:
    """Every input checked before any engine starts, as molt-train checks its own; a ConfigError names the
    flag. A checkpoint's engine context follows its model (`engine.max_model_len`)."""
    from molt_train.config import validate
    from molt_train.model_fit import resolve_from_model

    validate(config)
    if command.concurrency < 1:
        raise ConfigError("--concurrency: must be >= 1")
    check_loadable(config)
    if command.base_url:
        _reachable(command.base_url.replace("<session>", "molt-eval"))
    else:
        model, adapter = served(policy_dir(command.model))
        if adapter and config.engine.name != "vllm":
            raise ConfigError(f"--engine.name {config.engine.name}: {command.model} holds LoRA adapters, which "
                              "vLLM's LoRA serves: use vllm (or molt-merge them into full weights first)")
        resolve_from_model(config, model)


def policy_dir(model: str) -> Path:
    """The directory behind `--model`: a checkpoint's `policy/` (or a LoRA run's `adapter/`), a run's latest
    one's, or the model directory (`tiny.model_dir`)."""
    from molt_agents.tiny import model_dir
    from molt_train import checkpoint

    path = Path(model)
    if (path / "loop_state.json").is_file() or path.name.startswith("step_"):  # a checkpoint
        policy = checkpoint.policy_dir(path)
        if not (policy / "config.json").is_file() and not (policy / "adapter_config.json").is_file():
            raise ConfigError(f"--model {model}: the checkpoint has no policy (no {path / 'policy' / 'config.json'}); "
                              "it may be incomplete: pass another step_* directory")
        return policy
    if (path / "adapter_config.json").is_file():  # a LoRA adapter
        return path
    if (path / "checkpoints").is_dir():  # a run directory: its latest checkpoint
        latest = checkpoint.latest(path)
        if latest is None:
            raise ConfigError(f"--model {model}: the run has no finished checkpoint under {path / 'checkpoints'}")
        return policy_dir(str(latest))
    return model_dir(model)


def served(policy: Path) -> tuple[str, str | None]:
    """The model directory an engine loads for `policy_dir`'s answer, and the LoRA adapter it serves on it."""
    from molt_agents.hf_model import adapter_base

    if (policy / "adapter_config.json").is_file():
        return adapter_base(policy), str(policy)
    return str(policy), None


def _reachable(base_url: str) -> None:
    """Any HTTP answer will do (a 404 of a path prefix too): what fails here is the connection."""
    import httpx

    try:
        httpx.get(base_url, timeout=10.0)
    except httpx.HTTPError as error:
        raise ConfigError(f"--base_url {base_url}: unreachable ({type(error).__name__}: {error})") from None


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="molt-eval", unit="episode", dynamic_ncols=True, file=sys.stderr)


async def play_checkpoint(command: EvalCommand, config: Config) -> list[dict]:
    """The rollout worker's own evaluation, in this process."""
    from molt_train.evaluate import eval_sampling
    from molt_train.rollout import RolloutWorker

    model, adapter = served(policy_dir(command.model))
    worker = RolloutWorker(model, config.env, config.rollout, config.engine, eval_sampling(config),
                           seed=config.seed, agent=config.agent, adapter=adapter)
    try:
        with _progress(config.eval.episodes * config.eval.samples) as progress:
            return await worker.evaluate(list(range(config.eval.episodes)), config.eval.samples,
                                         eval_sampling(config), on_episode=lambda record: progress.update(1))
    finally:
        worker.close()


async def play_endpoint(command: EvalCommand, config: Config) -> list[dict]:
    """`--model` behind `--base_url`, `--concurrency` plays at a time."""
    import openai

    from molt_agents.episode import EndpointPlayer, play
    from molt_env.registry import load_class
    from molt_env.split import EVAL, eval_seed
    from molt_train.evaluate import episode_record, eval_sampling

    agent = load_class(config.agent)() if config.agent is not None else None
    player = EndpointPlayer(command.base_url, command.api_key, command.model, config.rollout.max_total_tokens, agent)
    gate, params = asyncio.Semaphore(command.concurrency), eval_sampling(config)
    refused = (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError)

    async def one(episode: int, sample: int, progress) -> dict:
        async with gate:
            try:
                played = await play(player, config.env, params, env_seed=eval_seed(episode), group_index=episode,
                                    index=sample, options={"split": EVAL}, rollout_id=f"{EVAL}-{episode}-{sample}",
                                    group_id=str(episode), timeout=config.rollout.episode_timeout, fatal=refused)
            except refused as error:
                raise ConfigError(f"--base_url {command.base_url}: the endpoint refused the request "
                                  f"({error.status_code}: {error.message})") from None
        progress.update(1)
        return episode_record(episode, eval_seed(episode), sample, played)

    with _progress(config.eval.episodes * config.eval.samples) as progress:
        return list(await asyncio.gather(*(one(e, s, progress) for e in range(config.eval.episodes)
                                           for s in range(config.eval.samples))))


if __name__ == "__main__":
    main()
