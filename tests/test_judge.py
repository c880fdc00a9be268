"""`molt_env.Judge`: retries, cache and concurrency against an endpoint that misbehaves on purpose (a small
HTTP server in this process that answers in the Chat Completions format: no model can be told to fail),
and a short run whose reward comes from `molt-serve` of a frozen tiny model, killed mid-run."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import molt_serve

from molt_env import Judge, JudgeError
from molt_env.judge import first_number, serve_policy


class Endpoint:
    """Answers `reply(prompt)` after `delay` seconds; the first `fail` requests get a 500."""

    def __init__(self, reply=lambda prompt: "Score: 7", fail: int = 0, delay: float = 0.0):
        self.reply, self.fail, self.delay = reply, fail, delay
        self.requests, self.open, self.most_open = [], 0, 0
        self.lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint.lock:
                    endpoint.requests.append(body)
                    endpoint.open += 1
                    endpoint.most_open = max(endpoint.most_open, endpoint.open)
                    failing = len(endpoint.requests) <= endpoint.fail
                time.sleep(endpoint.delay)
                with endpoint.lock:
                    endpoint.open -= 1
                content = endpoint.reply(body["messages"][0]["content"])
                data = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                   "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": content}}]}).encode()
                self.send_response(500 if failing else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    made = []

    def make(**kwargs):
        made.append(Endpoint(**kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()


def test_first_number_reads_the_score_and_refuses_what_is_not_one():
    assert first_number("7", 9) == pytest.approx(7 / 9)
    assert first_number("Score: 8/10 because...", 10) == 0.8
    assert first_number("2.5 out of 5", 5) == 0.5
    with pytest.raises(ValueError, match="no number in the judge's reply 'great'"):
        first_number("great", 10)
    with pytest.raises(ValueError, match="the judge's score 12 is outside 0..10"):
        first_number("12", 10)


def test_judge_retries_caches_and_asks_an_identical_request_once(endpoint):
    server = endpoint(fail=2)
    judge = Judge("Rate {answer}.", base_url=server.url, model="m", backoff=0.01)

    async def go():
        first = await judge(answer="a")  # two 500s, then the score
        again = await judge(answer="a")  # from the cache
        together = await asyncio.gather(*(judge(answer="b") for _ in range(5)))  # one request in flight
        return first, again, together

    first, again, together = asyncio.run(go())
    assert first == again == 0.7 and together == [0.7] * 5
    assert [r["messages"][0]["content"] for r in server.requests] == ["Rate a."] * 3 + ["Rate b."]
    assert server.requests[0]["temperature"] == 0.0 and server.requests[0]["max_tokens"] == 16


def test_judge_keeps_at_most_its_concurrency_in_flight(endpoint):
    server = endpoint(delay=0.2)
    judge = Judge("Rate {answer}.", base_url=server.url, max_concurrency=2)

    async def go():
        return await asyncio.gather(*(judge(answer=str(i)) for i in range(6)))

    assert asyncio.run(go()) == [0.7] * 6
    assert len(server.requests) == 6 and server.most_open == 2


def test_a_judge_that_keeps_failing_raises_and_names_why(endpoint):
    server = endpoint(reply=lambda prompt: "excellent")  # never a number
    judge = Judge("Rate {answer}.", base_url=server.url, retries=2, backoff=0.01)
    with pytest.raises(JudgeError, match=r"no score after 3 tries at .*; the last: ValueError: no number"):
        asyncio.run(judge(answer="a"))
    assert len(server.requests) == 3
    closed = server.url
    server.close()
    started = time.perf_counter()
    with pytest.raises(JudgeError, match="the last: APIConnectionError"):
        asyncio.run(Judge("Rate {answer}.", base_url=closed, retries=2, backoff=0.1)(answer="a"))
    assert time.perf_counter() - started >= 0.3  # backoff 0.1 then 0.2
    with pytest.raises(JudgeError, match="set MOLT_JUDGE_URL"):
        asyncio.run(Judge("Rate {answer}.")(answer="a"))


def test_a_judges_outage_drops_episodes_not_steps_and_molt_serve_then_drives_the_run(tmp_path, ray_address):
    """`judged_digit`, its judge's endpoint down when the run starts: every episode of the first steps is
    dropped and counted, none scored 0, and the run goes on. Once two steps are logged, `molt-serve` of the
    frozen tiny chat model starts on that endpoint's port, and from then on it scores the episodes. (The outage
    comes first so that no cached score can stand in for the endpoint.)"""
    out = tmp_path / "judged"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/s/judge/v1"
    env = {**os.environ, "MOLT_JUDGE_URL": url, "MOLT_JUDGE_API_KEY": "k3y"}
    run = subprocess.Popen([sys.executable, "-m", "molt_train.cli", "--out", str(out), "--ray.address", ray_address,
                            "--env", "judged_digit", "--steps", "10", "--rollout.groups_per_step", "4",
                            "--rollout.group_size", "4", "--train.async_queue_size", "0",
                            "--rollout.max_failed_steps", "0", "--log.tensorboard", "false"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert run.poll() is None, run.stderr.read()[-4000:]
        assert time.monotonic() < deadline, "no two steps within 400 s"
        time.sleep(0.5)
    with molt_serve("--api-key", "k3y", "--max-model-len", "512", "--model", "tiny:chat", "--port", str(port)) as (
            _, base):
        assert base.replace("<session>", "judge") == url
        served_after = len(metrics.read_text().splitlines())
        stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    failed = [r.get("episodes/failed/JudgeError", 0) for r in rows]
    print("rewards", [r["reward/mean"] for r in rows], "judge failures per step", failed,
          "endpoint up after step", served_after)
    why = (f"the endpoint came up after step {served_after}; every step's failures: "
           + str([{k: v for k, v in r.items() if k.startswith("episodes/")} for r in rows])
           + f"; the run's output ends:\n{(stdout + stderr)[-3000:]}")
    assert [r["step"] for r in rows] == list(range(1, 11)), why
    assert failed[:2] == [16, 16] and failed[-1] == 0 and served_after < 9, why
    # every episode was judged (the frozen judge answers the rubric with the same digit whatever the reply)
    # or dropped: none was scored 0
    assert all(r["rollouts/trained"] + r["episodes/failed"] == 16 for r in rows), why
    scored = [r for r in rows if r["rollouts/trained"]]
    score = scored[0]["reward/mean"]
    assert score * 9 == pytest.approx(round(score * 9)) and score > 0
    assert all(r["reward/mean"] == pytest.approx(score) and r["reward/std"] < 1e-9 for r in scored), why
    assert "an episode failed and was dropped:\nJudgeError: no score after 4 tries" in stdout + stderr


def test_a_judge_asks_the_policy_on_a_loopback_route_that_captures_nothing(loopback):
    """`Judge(base_url="policy")` reaches the engine its process registered (as a rollout worker registers its
    own); the loopback's session-less route answers it, opens no session and captures nothing."""
    import openai

    judge = Judge("Rate this: {text}", parse=lambda reply: float(len(reply)), base_url="policy", max_tokens=8)
    serve_policy(None)
    with pytest.raises(JudgeError, match="this process serves none"):
        asyncio.run(judge(text="a"))

    async def endpoint():
        return f"http://127.0.0.1:{loopback.port}/v1", loopback.api_key, "policy"

    serve_policy(endpoint)
    try:
        score = asyncio.run(judge(text="a reply"))
    finally:
        serve_policy(None)
    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{loopback.port}/v1", api_key=loopback.api_key)
    reply = direct.chat.completions.create(model="policy", max_tokens=8, temperature=0.0,
                                           messages=[{"role": "user", "content": "Rate this: a reply"}])
    print("the policy's reply to the judge:", repr(reply.choices[0].message.content))
    assert score == len(reply.choices[0].message.content) > 0
    assert reply.usage.completion_tokens > 0
    assert loopback.sessions == {} and loopback.captured == []


def test_a_run_judged_by_its_own_policy_judges_every_episode(tmp_path, ray_address):
    """`judged_digit` with MOLT_JUDGE_URL=policy: each rollout worker's engine answers the judge; every
    episode is scored by it (the judge's digit over 9), none dropped, and no judge token is trained."""
    out = tmp_path / "self-judged"
    result = subprocess.run([sys.executable, "-m", "molt_train.cli", "--out", str(out), "--ray.address", ray_address,
                             "--env", "judged_digit", "--steps", "3", "--rollout.groups_per_step", "4",
                             "--rollout.group_size", "4", "--train.async_queue_size", "0",
                             "--rollout.max_failed_steps", "0", "--log.tensorboard", "false"],
                            env={**os.environ, "MOLT_JUDGE_URL": "policy"}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print("rewards", [round(r["reward/mean"], 4) for r in rows], "right", [r["env/right"] for r in rows])
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["rollouts/trained"] == 16 and row.get("episodes/failed", 0) == 0
        assert row["reward/mean"] == pytest.approx(row["env/judge"])
        assert row["reward/mean"] * 16 * 9 == pytest.approx(round(row["reward/mean"] * 16 * 9), abs=1e-6)
        # what is trained is the episodes' replies alone (one segment each)
        assert row["tokens/trained"] == pytest.approx(16 * row["response_len/mean"])
