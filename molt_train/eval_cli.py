"""`molt-eval`: score a checkpoint, or a model behind an OpenAI-compatible endpoint, on held-out episodes.

    molt-eval --model runs/digit-X/checkpoints/step_000200 --env digit --episodes 64 --out report.json
    molt-eval --model gpt-4o-mini --base-url https://api.openai.com/v1 --api-key $KEY --env digit

The episodes are the evaluation range of `molt_env.split` (seeds training
never draws), the same ones `molt-train --eval.*` scores during a run, so a
hosted model and our checkpoint are compared on identical episodes. A
checkpoint (a run's `checkpoints/step_*`, its `policy/`, a run directory for
its latest checkpoint, or any Hugging Face directory) plays them on the vLLM
engine through the rollout worker's own code, with the env runner or
`--agent` through the loopback. With `--base-url`, `--model` is the name the
endpoint serves; the episodes go over the `openai` client
(`molt_agents.endpoint`), or `--agent` gets the endpoint as its base URL.
The report holds every play (reward, turns, tokens, failure) and the
summary of `evaluate.summarize`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path


class InputError(ValueError):
    """Bad input: the message names the flag and the problem."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="molt-eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="a checkpoint (RUN_DIR/checkpoints/step_N or its policy/), a run directory (its latest "
                             "checkpoint), a Hugging Face model directory, tiny:chat; with --base-url, the model "
                             "name the endpoint serves")
    parser.add_argument("--env", default="digit", help="environment, as molt-train --env (default: digit)")
    parser.add_argument("--agent", default=None,
                        help="a ChatAgent class (package.module:Class or path/file.py:Class) that plays each episode "
                             "(through the loopback, or against --base-url); default: the env runner")
    parser.add_argument("--episodes", type=int, default=64, help="held-out episodes (evaluation seeds 0..N-1)")
    parser.add_argument("--samples", type=int, default=1, help="plays per episode: the k of pass@k (default 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    parser.add_argument("--pass-threshold", type=float, default=1.0,
                        help="an episode passes when its reward is at least this (default 1.0)")
    parser.add_argument("--max-tokens", type=int, default=16, help="most tokens sampled per turn (default 16)")
    parser.add_argument("--max-total-tokens", type=int, default=512, help="token budget of an episode (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm", help="engine for a checkpoint")
    parser.add_argument("--dtype", default="float32", help="engine weight dtype for a checkpoint")
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible endpoint (e.g. molt-serve's base URL, "
                        "with <session> replaced by a session per play) to evaluate instead of a checkpoint")
    parser.add_argument("--api-key", default="none", help="API key of --base-url")
    parser.add_argument("--concurrency", type=int, default=16, help="plays in flight against --base-url")
    parser.add_argument("--episode-timeout", type=float, default=300.0, help="seconds a play may take (then failed)")
    parser.add_argument("--out", type=Path, default=None, help="write the report (JSON) here")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        check(args)
        started = time.perf_counter()
        records = asyncio.run(play_endpoint(args) if args.base_url else play_checkpoint(args))
    except InputError as error:
        sys.exit(f"molt-eval: {error}")
    from molt_train.evaluate import summarize

    summary = summarize(records, args.pass_threshold) | {"seconds": time.perf_counter() - started}
    report = {"model": args.model if args.base_url else str(policy_dir(args.model)), "env": args.env,
              "agent": args.agent, "base_url": args.base_url, "episodes": args.episodes, "samples": args.samples,
              "temperature": args.temperature, "pass_threshold": args.pass_threshold, "max_tokens": args.max_tokens,
              "seed": args.seed, "summary": summary, "plays": records}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    k = args.samples
    print(f"molt-eval: {args.env}, {summary['episodes']} episodes x {k} at temperature {args.temperature}: "
          f"reward {summary['reward']:.3f}, pass@1 {summary['pass@1']:.3f}"
          + (f", pass@{k} {summary[f'pass@{k}']:.3f}" if k > 1 else "")
          + f", {summary['failed']} failed, {summary['seconds']:.1f} s"
          + (f"; report {args.out}" if args.out else ""))


def check(args) -> None:
    """Every input checked before any engine starts; an InputError names the flag."""
    from molt_train.config import EvalConfig, validate_eval

    def need(ok: bool, flag: str, why: str):
        if not ok:
            raise InputError(f"--{flag.replace('_', '-')}: {why}")

    validate_eval(EvalConfig(episodes=args.episodes, samples=args.samples, temperature=args.temperature,
                             pass_threshold=args.pass_threshold), need, prefix="")
    need(args.max_tokens >= 1, "max_tokens", "must be >= 1")
    need(args.concurrency >= 1, "concurrency", "must be >= 1")
    import environments  # noqa: F401  (registers the bundled environments' short names)
    import molt_env

    try:
        molt_env.make(args.env)
    except Exception as error:  # an unknown name, or an environment that fails to build
        raise InputError(f"--env {args.env}: {str(error).splitlines()[0]}") from None
    if args.agent is not None:
        from molt_env.registry import load_class

        try:
            load_class(args.agent)
        except ValueError as error:
            raise InputError(f"--agent: {error}") from None
    if args.base_url:
        _reachable(args.base_url.replace("<session>", "molt-eval"))
    else:
        policy_dir(args.model)


def policy_dir(model: str) -> Path:
    """The Hugging Face directory behind `--model`: itself, a checkpoint's `policy/`, or a run's latest one's."""
    if model.startswith("tiny:"):
        from molt_agents.tiny import tiny_model

        return tiny_model(model.split(":", 1)[1])
    path = Path(model)
    if (path / "config.json").is_file():
        return path
    if (path / "loop_state.json").is_file() or path.name.startswith("step_"):  # a checkpoint
        if not (path / "policy" / "config.json").is_file():
            raise InputError(f"--model {model}: the checkpoint has no policy (no {path / 'policy' / 'config.json'}); "
                             "it may be incomplete: pass another step_* directory")
        return path / "policy"
    if (path / "checkpoints").is_dir():  # a run directory: its latest checkpoint
        from molt_train import checkpoint

        latest = checkpoint.latest(path)
        if latest is None:
            raise InputError(f"--model {model}: the run has no finished checkpoint under {path / 'checkpoints'}")
        return policy_dir(str(latest))
    if not path.exists():
        raise InputError(f"--model {model}: no such directory")
    raise InputError(f"--model {model}: not a Hugging Face model directory (no config.json), a checkpoint "
                     "(step_*/policy) or a run directory (checkpoints/); for an endpoint pass --base-url")


def _reachable(base_url: str) -> None:
    """Any HTTP answer will do (a 404 of a path prefix too): what fails here is the connection."""
    import httpx

    try:
        httpx.get(base_url, timeout=10.0)
    except httpx.HTTPError as error:
        raise InputError(f"--base-url {base_url}: unreachable ({type(error).__name__}: {error})") from None


def _episodes(args) -> list[tuple[int, int]]:
    return [(episode, sample) for episode in range(args.episodes) for sample in range(args.samples)]


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="molt-eval", unit="episode", dynamic_ncols=True, file=sys.stderr)


def _sampling(args) -> dict:
    return {"temperature": args.temperature, "top_p": 1.0, "max_tokens": args.max_tokens, "seed": args.seed}


# ---------------------------------------------------------------------------
# A checkpoint: the rollout worker's own evaluation, in this process


async def play_checkpoint(args) -> list[dict]:
    from molt_train.model_fit import context_limit, model_config
    from molt_train.rollout import RolloutWorker

    model = policy_dir(args.model)
    max_model_len = context_limit(model_config(model)) or 4096
    if args.max_total_tokens > max_model_len:
        raise InputError(f"--max-total-tokens: {args.max_total_tokens} is more than the model's context "
                         f"({max_model_len} tokens)")
    engine = {"name": args.engine, "dtype": args.dtype, "max_model_len": max_model_len, "options": {}}
    worker = RolloutWorker(str(model), args.env, engine, _sampling(args), args.max_total_tokens, seed=args.seed,
                           agent=args.agent, episode_timeout=args.episode_timeout)
    try:
        with _progress(args.episodes * args.samples) as progress:
            return await worker.evaluate(list(range(args.episodes)), args.samples, _sampling(args),
                                         on_episode=lambda record: progress.update(1))
    finally:
        if worker.serving is not None:
            worker.serving.cancel()
        worker.engine.close()


# ---------------------------------------------------------------------------
# An OpenAI-compatible endpoint


async def play_endpoint(args) -> list[dict]:
    import openai

    import molt_env
    from molt_env.split import EVAL, eval_seed
    from molt_train.evaluate import blank_record

    gate = asyncio.Semaphore(args.concurrency)
    agent = None
    if args.agent is not None:
        from molt_env.registry import load_class

        agent = load_class(args.agent)()

    async def play(episode: int, sample: int) -> dict:
        seed = eval_seed(episode)
        record = blank_record(episode, seed, sample)
        base_url = args.base_url.replace("<session>", f"eval-{episode}-{sample}")
        client = openai.AsyncOpenAI(base_url=base_url, api_key=args.api_key)
        sampling = _sampling(args) | {"seed": args.seed + 7919 * episode + sample}
        async with gate:
            try:
                env = molt_env.make(args.env)
                if agent is None:
                    from molt_agents.endpoint import run_endpoint_episode

                    played = run_endpoint_episode(env, client, args.model, sampling=sampling, seed=seed,
                                                  options={"split": EVAL}, max_total_tokens=args.max_total_tokens)
                else:
                    played = _agent_episode(agent, env, base_url, args, sampling, seed)
                return record | await asyncio.wait_for(played, args.episode_timeout)
            except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError) as error:
                raise InputError(f"--base-url {args.base_url}: the endpoint refused the request "
                                 f"({error.status_code}: {error.message})") from None
            except asyncio.TimeoutError:
                return record | {"failure": f"timeout: the episode took over {args.episode_timeout} s"}
            except Exception as error:  # the environment's, the agent's or the endpoint's: this play only
                return record | {"failure": f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"}
            finally:
                await client.close()

    with _progress(args.episodes * args.samples) as progress:
        async def counted(episode, sample):
            record = await play(episode, sample)
            progress.update(1)
            return record

        return list(await asyncio.gather(*(counted(e, s) for e, s in _episodes(args))))


async def _agent_episode(agent, env, base_url: str, args, sampling: dict, seed: int) -> dict:
    """`--agent` against the endpoint: the agent's context points at it; its reward is the play's."""
    import inspect

    from molt_agents.agent import AgentContext, AgentResult
    from molt_env.spaces import as_messages
    from molt_env.split import EVAL

    observation, info = await env.areset(seed=seed, options={"split": EVAL})
    ctx = AgentContext(base_url=base_url, api_key=args.api_key, model=args.model, messages=as_messages(observation),
                       tools=getattr(env, "tools", None), sampling=sampling, task=info, session_id="", env=env)
    result = await agent.run(ctx) if inspect.iscoroutinefunction(agent.run) else await asyncio.to_thread(agent.run, ctx)
    reward = result.reward if isinstance(result, AgentResult) else float(result)
    return {"reward": reward, "turns": None, "completion_tokens": None, "total_tokens": None}


if __name__ == "__main__":
    main()
