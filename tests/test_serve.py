"""`molt-serve` as a user starts it: a subprocess, a stock client, trajectories on disk."""

import json
import subprocess
import sys

import httpx
import openai
import pytest
from conftest import molt_serve


def test_molt_serve_captures_sessions_to_a_file(tmp_path):
    out = tmp_path / "trajectories.jsonl"
    with molt_serve("--api-key", "k3y", "--trajectories", str(out), "--max-model-len", "512") as (_, base):
        assert base.endswith("/s/<session>/v1")
        client = openai.OpenAI(base_url=base.replace("<session>", "mine"), api_key="k3y", max_retries=0)
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=5, n=2, seed=0)
        finish = httpx.post(base.replace("<session>/v1", "mine/finish"), json={"reward": 0.75},
                            headers={"Authorization": "Bearer k3y"})
        assert finish.json()["segments"] == 2
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert record["session"] == "mine" and record["reward"] == 0.75
        assert {"token_ids", "mask", "logprobs", "versions", "finish_reason"} <= set(record)
        assert all((lp is not None) == bool(m) for m, lp in zip(record["mask"], record["logprobs"]))
        # the session's last chat request and its first reply
        assert record["messages"] == [{"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": reply.choices[0].message.content}]
    assert sum(sum(r["mask"]) for r in records) == reply.usage.completion_tokens


@pytest.mark.parametrize("model,needle", [("/no/such/model", "not a Hugging Face model directory (no such directory)"),
                                          ("tiny:big", "no tiny model 'big'; choose tiny:dense")])
def test_molt_serve_with_a_model_it_cannot_load_says_so_in_one_line(model, needle):
    result = subprocess.run([sys.executable, "-m", "molt_agents.serve", "--model", model], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith(f"molt-serve: --model {model}: {needle}"), line
