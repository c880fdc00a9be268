"""molt-view on a long run: how fast a run of 100k saved episodes opens, and how fast one episode opens.

    .venv/bin/python bench/view.py [--steps 1000] [--episodes 100] [--dir /tmp/molt-view-bench] [--repeats 5]

Builds a synthetic run directory once (kept in `--dir`, keyed by its size):
`--steps` steps of `--episodes` episodes each (groups of 8 and, every 10
steps, 8 evaluation plays), written in the saved rollouts' format (each
step a gzip member of `saved_rollouts._line` records, an `index_line` per
member; gzip level 1 instead of `_member`'s 9, to build it in a minute),
each episode a tool-calling chat of about 300 tokens rendered by the tiny
models' tokenizer, with engine and trainer logprobs and versions; a
`metrics.jsonl` line per step with 60 metrics; the tokenizer as a
checkpoint's. Then starts `molt-view` on it as a user does (a subprocess,
over a real socket) and times with httpx: from the process's start to the
page's data drawn (the page, the runs, the two default curves, the first
page of the last step's episodes, as the page asks for them, in order);
then each request alone (the first time, and the median of `--repeats`
after). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from molt_train.saved_rollouts import _line, index_line

QUESTION = ("Locker {locker} holds one digit. Look it up with the lookup tool (the id is the letter's place in the "
            "alphabet) and answer with the digit alone. Think about which id to use before you call the tool.")


def episode_template(tokenizer, rng: random.Random) -> dict:
    """One tool-calling chat, its tokens and which of them the policy sampled (rendered turn by turn)."""
    locker = rng.choice("ABCDEFGH")
    answer = str(rng.randrange(10))
    messages = [
        {"role": "system", "content": "You are a careful agent. Use the tools you are given when a question needs "
                                      "facts you do not have, and answer briefly."},
        {"role": "user", "content": QUESTION.format(locker=locker)},
        {"role": "assistant", "content": f"Locker {locker} is letter number {ord(locker) - 64}, so I look up that "
                                         f"id and read the digit.\n<tool_call>\n{{\"name\": \"lookup\", "
                                         f"\"arguments\": {{\"id\": {ord(locker) - 64}}}}}\n</tool_call>"},
        {"role": "tool", "tool_call_id": "call_0", "name": "lookup", "content": f"It holds {answer}."},
        {"role": "assistant", "content": f"The lookup says locker {locker} holds {answer}. Nothing else was asked, "
                                         f"so I answer with the digit and stop here. The answer is {answer}."}]
    ids, mask = [], []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
            mask += [0] * (len(prompt) - len(ids))
            ids = list(prompt)
        whole = tokenizer.apply_chat_template(messages[:i + 1], tokenize=True, return_dict=False)
        mask += [int(message["role"] == "assistant")] * (len(whole) - len(ids))
        ids = list(whole)
    assert len(ids) == len(mask), "the chat template rendered a turn that does not extend the one before"
    return {"token_ids": ids, "mask": mask, "messages": messages}


def records_of_step(step: int, episodes: int, templates: list[dict], rng: random.Random) -> list[dict]:
    """A step's training records (groups of 8) and, every 10 steps, 8 evaluation records."""
    evaluated = step % 10 == 0
    records = []
    for e in range(episodes + (8 if evaluated else 0)):
        template = templates[(step * 7 + e) % len(templates)]
        mask = template["mask"]
        logprobs = [-rng.expovariate(3.0) if m else None for m in mask]
        reward = float(rng.random() < 0.4)
        record = {"token_ids": template["token_ids"], "logprobs": logprobs, "mask": mask,
                  "versions": [step - 1 if m else -1 for m in mask], "reward": reward, "segment": 0,
                  "num_segments": 1, "finish_reason": "stop", "truncated": False, "routes": None, "mm": None,
                  "info": {"tool_calls": 1, "called": True, "right_id": reward > 0, "turns": 2,
                           "step_rewards": [0.0, reward]}, "messages": template["messages"]}
        if e < episodes:
            group = e // 8
            records.append({"step": step, "split": "train", **record, "rollout_id": f"{step * 1000 + group}-{e % 8}",
                            "group_id": str(step * 1000 + group), "trained": True, "advantage": reward - 0.4,
                            "trainer_logprobs": [p + rng.gauss(0, 1e-3) if p is not None else None for p in logprobs]})
        else:
            episode = e - episodes
            records.append({"step": step, "split": "eval", "episode": episode, "sample": 0, **record,
                            "rollout_id": f"eval-{episode}-0", "group_id": str(episode)})
    return records


def metrics_of_step(step: int, rng: random.Random) -> dict:
    line = {"step": step, "reward/mean": min(1.0, 0.2 + step / 2000 + rng.gauss(0, 0.05)), "version": step}
    line |= {f"bench/metric_{i:02d}": rng.random() for i in range(57)}
    if step % 10 == 0:
        line["eval/reward"] = min(1.0, 0.2 + step / 2000 + rng.gauss(0, 0.03))
    return line


def build(run_dir: Path, steps: int, episodes: int) -> None:
    from molt_agents.tiny.tokenizer import build_tokenizer

    policy = run_dir / "checkpoints" / f"step_{steps:06d}" / "policy"
    tokenizer = build_tokenizer(policy)
    rng = random.Random(0)
    templates = [episode_template(tokenizer, rng) for _ in range(24)]
    rollouts = run_dir / "rollouts"
    rollouts.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"env: locker\nmodel: {policy}\nsteps: {steps}\n")
    with (run_dir / "metrics.jsonl").open("w") as metrics, (rollouts / "index.jsonl").open("w") as index:
        for step in range(1, steps + 1):
            records = records_of_step(step, episodes, templates, rng)
            path = rollouts / f"steps_{(step - 1) // 100 * 100 + 1:06d}.jsonl.gz"  # --log.rollouts_every 100
            offset = path.stat().st_size if path.exists() else 0
            member = gzip.compress("".join(_line(record) for record in records).encode(), compresslevel=1, mtime=0)
            with path.open("ab") as out:
                out.write(member)
            index.write(index_line(step, path.name, offset, len(member), records))
            metrics.write(json.dumps(metrics_of_step(step, rng)) + "\n")
            if step % 100 == 0:
                print(f"built step {step} of {steps}", file=sys.stderr)


def timed(client: httpx.Client, path: str, **params) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = client.get(path, params=params)
    response.raise_for_status()
    return (time.perf_counter() - started) * 1000, response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--episodes", type=int, default=100, help="training episodes per step")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/molt-view-bench"), help="where the run is built")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    run_dir = args.dir / f"{args.steps}x{args.episodes}"
    if not (run_dir / "metrics.jsonl").exists():
        partial = run_dir.with_suffix(".partial")
        subprocess.run(["rm", "-rf", str(partial)], check=True)
        started = time.perf_counter()
        build(partial, args.steps, args.episodes)
        partial.rename(run_dir)
        print(f"built {run_dir} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    size = sum(p.stat().st_size for p in (run_dir / "rollouts").iterdir()) / 2**20
    last = args.steps

    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "molt_train.view.server", str(run_dir), "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        listening = (time.perf_counter() - started) * 1000
        url = line.split(" at ")[1].strip()
        rows: list[tuple[str, float, float | None]] = [("molt-view started: listening", listening, None)]
        with httpx.Client(base_url=url, timeout=60) as client:
            page = [("page opens: GET /", "/", {}),  # what the page asks for when it opens, in its order
                    ("page opens: GET /api/runs (reads metrics.jsonl and index.jsonl)", "/api/runs", {}),
                    ("page opens: GET metrics reward/mean", "/api/run/0/metrics", {"key": "reward/mean"}),
                    ("page opens: GET metrics eval/reward", "/api/run/0/metrics", {"key": "eval/reward"}),
                    (f"page opens: GET step {last} episodes", f"/api/run/0/step/{last}/episodes", {})]
            opened = [(name, timed(client, path, **params)[0], None) for name, path, params in page]
            rows.append(("molt-view started: page drawn (start to last request)",
                         (time.perf_counter() - started) * 1000, None))
            rows += opened + [("page opens: total", sum(ms for _, ms, _ in opened), None)]

            rollout = client.get(f"/api/run/0/step/{last}/episodes", params={"sort": "reward"}).json()["rows"][0]
            middle = args.steps // 2
            requests = [("GET /", "/", {}), ("GET /api/runs", "/api/runs", {}),
                        ("GET metrics (reward/mean)", "/api/run/0/metrics", {"key": "reward/mean"}),
                        (f"GET step {middle} episodes (first: parses its index line)",
                         f"/api/run/0/step/{middle}/episodes", {}),
                        (f"GET step {middle} episodes, sorted by reward, filtered",
                         f"/api/run/0/step/{middle}/episodes", {"sort": "reward", "order": "desc", "split": "train",
                                                                "info": "called=true"}),
                        (f"GET episode of step {last} (first: reads its gzip member, loads the tokenizer)",
                         f"/api/run/0/step/{last}/episode", {"rollout": rollout["rollout_id"]}),
                        (f"GET episode of step {middle} (first: reads its gzip member)",
                         f"/api/run/0/step/{middle}/episode", {"rollout": f"{middle * 1000}-3"})]
            for name, path, params in requests:
                first, response = timed(client, path, **params)
                again = statistics.median(timed(client, path, **params)[0] for _ in range(args.repeats))
                rows.append((name, first, again))
            episode = response.json()
    finally:
        process.terminate()
        process.wait(timeout=30)

    episodes = args.steps * args.episodes + args.steps // 10 * 8
    print(f"\nmolt-view on {episodes} episodes ({args.steps} steps x {args.episodes} train episodes, 8 eval plays "
          f"every 10 steps; {len(episode['segments'][0]['tokens']['ids'])} tokens each; {size:.0f} MiB of "
          f"gzipped rollouts)\n")
    print("| what | first (ms) | again, median (ms) |")
    print("|---|---:|---:|")
    for name, first, again in rows:
        print(f"| {name} | {first:.0f} | {'' if again is None else f'{again:.1f}'} |")


if __name__ == "__main__":
    main()
