"""The loopback under load: N concurrent multi-turn chat sessions through molt-serve and vLLM's own server.

    .venv/bin/python bench/loopback_load.py                       # 256 sessions x 3 turns x 16 tokens, 5 runs
    .venv/bin/python bench/loopback_load.py --servers molt molt@/tmp/molt-base vllm --runs 5

Each session is a multi-turn chat played by a plain `httpx.AsyncClient` that
reuses its connections (keep-alive, httpx's default idle expiry): a user
turn, the reply appended, the next user turn, on the Chat Completions route
(`/chat/completions`, `messages`) and on the Responses route (`/responses`,
the whole conversation as `input`). Two client modes: `session`, one
`AsyncClient` per session (each agent program its own), and `shared`, one
for all, whose pool then holds a connection per session (httpcore's pool
scans its idle connections once per idle connection on every request, so at
256 connections this client, not the server, sets the pace); the shared
client first idles `--idle` s on its warm-up connections. Every run starts
its server fresh, warms it up, plays both routes in both modes and stops
it; the servers alternate run by run.

For molt-serve every sampled token must be captured: after the timed part
each session is finished, and the trajectories molt-serve wrote must hold,
session by session, exactly the replies' tokens (as many as the usage
counted, decoding to the replies' texts, turn by turn).

Servers: `molt` (this checkout), `molt@DIR` (the checkout in DIR: a baseline
commit's worktree), `vllm` (`python -m vllm.entrypoints.openai.api_server` on
the same model, dtype and context). A table goes to stdout and
`results/loopback-<time>/README.md`, every run's numbers to `runs.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "bench-key"


# --------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One server process: `molt`, `molt@DIR` or `vllm`, on `model`; `base(session)` is a session's base URL."""

    def __init__(self, name: str, model: str, max_model_len: int, out: Path, extra: list[str]):
        self.name, self.port = name, free_port()
        self.trajectories = out / f"trajectories-{name.replace('/', '_')}-{time.time_ns()}.jsonl"
        env = dict(os.environ)
        if name.startswith("molt"):
            tree = Path(name.split("@", 1)[1]) if "@" in name else ROOT
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
            command = [sys.executable, "-m", "molt_agents.serve", "--model", model, "--port", str(self.port),
                       "--api-key", API_KEY, "--max-model-len", str(max_model_len),
                       "--trajectories", str(self.trajectories), *extra]
            cwd = tree
        elif name == "vllm":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, what molt-serve's engine takes on CPU
            command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                       "--port", str(self.port), "--api-key", API_KEY, "--served-model-name", "policy",
                       "--dtype", "float32", "--max-model-len", str(max_model_len),
                       "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *extra]
            cwd = ROOT
        else:
            raise SystemExit(f"unknown server {name!r}: molt, molt@DIR or vllm")
        self.log = out / f"server-{name.replace('/', '_')}-{time.time_ns()}.log"
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=self.log.open("w"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.command = command

    @property
    def molt(self) -> bool:
        return self.name.startswith("molt")

    def base(self, session: str) -> str:
        return f"http://127.0.0.1:{self.port}" + (f"/s/{session}/v1" if self.molt else "/v1")

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: "
                                   f"{self.log.read_text()[-3000:]}")
            try:
                reply = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2,
                                  headers={"Authorization": f"Bearer {API_KEY}"})
                if reply.status_code in (200, 404):  # molt-serve has no /health: a 404 says it listens
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start in {timeout} s")

    def cpu_seconds(self) -> float:
        """CPU time so far of the server's processes (its process group: vLLM's engine core included)."""
        total = 0.0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.process.pid:  # pgrp: the server started a session of its own
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


# --------------------------------------------------------------------------
# Sessions


def user_turn(session: int, turn: int) -> str:
    a, b = session % 10, (session // 10 + turn) % 10
    return f"What is {a} + {b}?" if turn == 0 else f"And {b} + {a + turn}?"


def reply_of(route: str, body: dict) -> tuple[str, int]:
    """The reply's text and its sampled token count, from a chat completion or a Responses object."""
    if route == "chat":
        return body["choices"][0]["message"]["content"] or "", body["usage"]["completion_tokens"]
    text = "".join(part.get("text", "") for item in body["output"] if item.get("type") == "message"
                   for part in item.get("content", []))
    return text, body["usage"]["output_tokens"]


async def play(client: httpx.AsyncClient | None, server: Server, route: str, session: str, index: int,
               turns: int, max_tokens: int, seed: int | None) -> dict:
    """One session's turns; its replies, token counts and the first error, if one ended it. Without `client`
    the session opens its own (its connection reused from turn to turn), as an agent program would."""
    if client is None:
        async with own_client(1) as client:
            return await play(client, server, route, session, index, turns, max_tokens, seed)
    messages, replies, tokens = [], [], []
    url = server.base(session) + ("/chat/completions" if route == "chat" else "/responses")
    try:
        for turn in range(turns):
            messages.append({"role": "user", "content": user_turn(index, turn)})
            body = ({"model": "policy", "messages": messages, "max_tokens": max_tokens} if route == "chat" else
                    {"model": "policy", "input": messages, "max_output_tokens": max_tokens, "store": False})
            if seed is not None:
                body["seed"] = seed + index
            response = await client.post(url, json=body)
            response.raise_for_status()
            text, count = reply_of(route, response.json())
            replies.append(text)
            tokens.append(count)
            messages.append({"role": "assistant", "content": text})
        return {"session": session, "replies": replies, "tokens": tokens, "error": None}
    except Exception as error:  # noqa: BLE001 - recorded and counted: the benchmark's errors column
        detail = getattr(getattr(error, "response", None), "text", "")[:300]
        return {"session": session, "replies": replies, "tokens": tokens,
                "error": f"{type(error).__name__}: {error} {detail}".strip()}


TLS = httpx.create_ssl_context()  # built once: httpx would load the CA bundle again for every client


def own_client(connections: int, timeout: float = 600) -> httpx.AsyncClient:
    """A plain client: httpx's keep-alive defaults, `connections` at once."""
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
                             timeout=timeout, verify=TLS, headers={"Authorization": f"Bearer {API_KEY}"})


async def load(server: Server, route: str, client_mode: str, prefix: str, args) -> dict:
    async with own_client(args.sessions, args.timeout) as client:
        # warm-up: a few short sessions; a shared client then idles (`--idle`) and reuses their connections
        await asyncio.gather(*(play(client, server, route, f"{prefix}-warm{i}", i, 1, args.max_tokens, args.seed)
                               for i in range(8)))
        if client_mode == "shared":
            await asyncio.sleep(args.idle)
        start, server_cpu, client_cpu = time.perf_counter(), server.cpu_seconds(), time.process_time()
        sessions = await asyncio.gather(*(play(client if client_mode == "shared" else None, server, route,
                                               f"{prefix}-{i}", i, args.turns,
                                               args.max_tokens, args.seed) for i in range(args.sessions)))
        wall = time.perf_counter() - start
        server_cpu, client_cpu = server.cpu_seconds() - server_cpu, time.process_time() - client_cpu
        finish_s = None
        if server.molt:
            start = time.perf_counter()
            finished = await asyncio.gather(*(client.post(f"http://127.0.0.1:{server.port}/s/{s}/finish",
                                                          json={"reward": 0.0})
                                              for s in [f"{prefix}-{i}" for i in range(args.sessions)]
                                              + [f"{prefix}-warm{i}" for i in range(8)]),
                                            return_exceptions=True)
            finish_s = time.perf_counter() - start
            for record, reply in zip(sessions, finished):
                if isinstance(reply, Exception) or reply.status_code != 200:
                    record["error"] = record["error"] or f"finish: {reply}"
    errors = [s["error"] for s in sessions if s["error"]]
    tokens = sum(sum(s["tokens"]) for s in sessions)
    return {"server": server.name, "route": route, "client": client_mode, "sessions": args.sessions,
            "turns": args.turns, "max_tokens": args.max_tokens, "wall_s": wall, "sessions_per_s": args.sessions / wall,
            "tokens": tokens, "tokens_per_s": tokens / wall, "server_cpu_s": server_cpu,
            "client_cpu_s": client_cpu, "errors": len(errors), "error_kinds": errors[:5],
            "finish_s": finish_s, "server_alive": server.alive(), "_sessions": sessions}


# --------------------------------------------------------------------------
# Capture check (molt-serve)


def check_capture(trajectories: Path, runs: list[dict], tokenizer) -> None:
    """Set `captured` on each molt run: whether every session's sampled tokens are in its trajectories."""
    by_session: dict[str, list[dict]] = {}
    if trajectories.exists():
        for line in trajectories.read_text().splitlines():
            record = json.loads(line)
            by_session.setdefault(record["session"], []).append(record)
    for run in runs:
        problems = []
        for session in run["_sessions"]:
            if session["error"]:
                continue
            records = sorted(by_session.get(session["session"], []), key=lambda r: r["segment"])
            spans = []  # the sampled tokens, one run of mask 1s per reply
            for record in records:
                current: list[int] = []
                for token, mask in zip(record["token_ids"], record["mask"]):
                    if mask:
                        current.append(token)
                    elif current:
                        spans.append(current)
                        current = []
                if current:
                    spans.append(current)
            counts = [len(span) for span in spans]
            texts = [tokenizer.decode([t for t in span if t != tokenizer.eos_token_id], skip_special_tokens=True)
                     for span in spans]
            if counts != session["tokens"] or texts != session["replies"]:
                problems.append(f"{session['session']}: captured {counts} {texts!r}, "
                                f"replied {session['tokens']} {session['replies']!r}")
        run["captured"] = not problems
        run["capture_problems"] = problems[:3]


# --------------------------------------------------------------------------
# Runs and the table


def table(runs: list[dict]) -> str:
    lines = ["| client | server | route | runs | wall s (median, min-max) | sessions/s | tokens/s | server CPU s "
             "| client CPU s | errors | captured |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted(dict.fromkeys((r["client"], r["server"], r["route"]) for r in runs),
                  key=lambda k: (k[0], k[2]))
    for client, server, route in keys:
        group = [r for r in runs if (r["client"], r["server"], r["route"]) == (client, server, route)]
        done = [r for r in group if "wall_s" in r]
        walls = [r["wall_s"] for r in done]
        captured = {r.get("captured") for r in done}
        lines.append(
            f"| {client} | {server} | {route} | {len(group)} | "
            + (f"{statistics.median(walls):.2f} ({min(walls):.2f}-{max(walls):.2f}) | "
               f"{statistics.median(r['sessions_per_s'] for r in done):.1f} | "
               f"{statistics.median(r['tokens_per_s'] for r in done):.0f} | "
               f"{statistics.median(r['server_cpu_s'] for r in done):.1f} | "
               f"{statistics.median(r['client_cpu_s'] for r in done):.1f} | " if done else "- | - | - | - | - | ")
            + f"{sum(r.get('errors', 0) for r in done)} + {len(group) - len(done)} failed runs | "
            + ("-" if captured == {None} else "all" if captured == {True} else "NO") + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=["molt", "vllm"],
                        help="servers to alternate: molt, molt@DIR (another checkout), vllm")
    parser.add_argument("--routes", nargs="+", default=["chat", "responses"], choices=["chat", "responses"])
    parser.add_argument("--runs", type=int, default=5, help="runs per server (each on a fresh server)")
    parser.add_argument("--sessions", type=int, default=256, help="concurrent sessions")
    parser.add_argument("--turns", type=int, default=3, help="chat turns per session")
    parser.add_argument("--max-tokens", type=int, default=16, help="max tokens per reply")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed each request (session's index added); default: unseeded")
    parser.add_argument("--idle", type=float, default=4.9,
                        help="seconds between the warm-up and the timed sessions, on the warm-up's connections: "
                             "just under httpx's idle expiry (5 s), where a server that closes idle connections "
                             "at 5 s races the client")
    parser.add_argument("--clients", nargs="+", default=["session", "shared"], choices=["session", "shared"],
                        help="client modes, each run on every server start: one httpx.AsyncClient per session "
                             "(each agent its own), or one shared by all (its pool holds a connection per session)")
    parser.add_argument("--timeout", type=float, default=600, help="client timeout per request, seconds")
    parser.add_argument("--model", default="tiny:chat", help="model directory or tiny model name")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--molt-args", default="", help="extra molt-serve flags (one string)")
    parser.add_argument("--vllm-args", default="", help="extra vLLM server flags (one string)")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/loopback-<time>")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from molt_agents.tiny import model_dir

    model = str(model_dir(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    out = args.out or ROOT / "bench" / "results" / f"loopback-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for run_index in range(args.runs):
        for name in args.servers:
            extra = (args.vllm_args if name == "vllm" else args.molt_args).split()
            server = Server(name, model, args.max_model_len, out, extra)
            try:
                server.wait_ready()
                routes = args.routes if run_index % 2 == 0 else args.routes[::-1]
                batch = []
                for route, client_mode in [(r, c) for c in args.clients for r in routes]:
                    try:
                        batch.append(asyncio.run(load(server, route, client_mode,
                                                      f"r{run_index}-{route}-{client_mode}", args)))
                    except Exception as error:  # noqa: BLE001 - the server died: record it, go on
                        batch.append({"server": name, "route": route, "client": client_mode,
                                      "failed": f"{type(error).__name__}: {error}"})
                    if not server.alive():
                        batch[-1]["server_died"] = server.log.read_text()[-2000:]
                        break
            except Exception as error:  # noqa: BLE001
                failed = f"{type(error).__name__}: {error}"
                batch = [{"server": name, "route": route, "client": c, "failed": failed}
                         for c in args.clients for route in args.routes]
            finally:
                server.stop()
            if server.molt:
                check_capture(server.trajectories, [r for r in batch if "_sessions" in r], tokenizer)
                server.trajectories.unlink(missing_ok=True)
            for record in batch:
                record["run"], record["command"] = run_index, " ".join(server.command)
                print(json.dumps({k: v for k, v in record.items() if k not in ("_sessions", "command")}),
                      flush=True)
            runs += batch
    for record in runs:
        record.pop("_sessions", None)
    (out / "runs.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                               "runs": runs}, indent=1))
    report = table(runs)
    (out / "README.md").write_text(f"`{' '.join(sys.argv)}`\n\n{report}\n")
    print(report)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
