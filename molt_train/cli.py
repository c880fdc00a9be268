"""`molt-train`: parse the config tree, print it resolved, run.

The training loop lands with the trainer issue. Until then a run checks the
stack end to end: it loads the model into the rollout engine, plays one
episode of the environment and prints every sampled token with its logprob
and weight version, the facts the trainer will consume.
"""

from __future__ import annotations

import asyncio
import sys

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from molt_train.config import Config

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


def parse_config(argv: list[str] | None = None) -> tuple[Config, str]:
    """The validated `Config` and its YAML dump (what the run directory keeps)."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    namespace.pop("config", None)
    config = parser.instantiate(namespace)
    return Config(**{k: v for k, v in vars(config).items()}), parser.dump(namespace)


async def _play_once(config: Config, model: str) -> None:
    from transformers import AutoTokenizer

    import molt_env
    from molt_agents.engines import SamplingParams, make_engine
    from molt_agents.runner import run_episode

    env = molt_env.make(config.env)
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = make_engine(config.engine.name, model, dtype=config.engine.dtype,
                         seed=config.seed, max_model_len=config.engine.max_model_len)
    try:
        params = SamplingParams(temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                                max_tokens=config.rollout.max_tokens, seed=config.seed)
        trajectories = await run_episode(env, engine, tokenizer, params, seed=config.seed,
                                         max_total_tokens=config.engine.max_model_len)
    finally:
        engine.close()
    for trajectory in trajectories:
        molt_env.check(trajectory)
        first = trajectory.mask.index(1)
        print(f"\nepisode of {config.env!r}: reward {trajectory.reward}, {trajectory.info['turns']} turn(s), "
              f"{trajectory.num_tokens} tokens of which {trajectory.num_trainable} sampled")
        print(f"prompt: {tokenizer.decode(trajectory.token_ids[:first])!r}")
        print(f"\n{'pos':>4} {'token_id':>8} {'logprob':>10} {'version':>7}  token")
        for i, (token, mask, logprob, version) in enumerate(
                zip(trajectory.token_ids, trajectory.mask, trajectory.logprobs, trajectory.versions)):
            if mask:
                print(f"{i:>4} {token:>8} {logprob:>10.4f} {version:>7}  {tokenizer.decode([token])!r}")


def main(argv: list[str] | None = None) -> None:
    config, resolved = parse_config(sys.argv[1:] if argv is None else argv)
    import environments  # noqa: F401  (registers the bundled environments' short names)
    from molt_agents.tiny import tiny_model

    model = config.model or str(tiny_model("dense"))
    print("# resolved config\n" + resolved + f"# model directory: {model}")
    print("\nmolt-train: the training loop is not built yet; checking the stack by playing one episode.")
    asyncio.run(_play_once(config, model))


if __name__ == "__main__":
    main()
