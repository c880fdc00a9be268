"""Shared fixtures: the tiny models and the session's vLLM engine.

vLLM keeps process-global parallel state, so one process holds one engine at
a time: `vllm_engines.get(model_dir)` returns the live engine for that model,
closing the previous one when a test asks for a different model. Tests of one
model therefore share one engine (about 2 s to start, plus the import).
"""

import asyncio
import contextlib
import os

import pytest

# Keep the 2-core test machine responsive: one thread per process unless asked otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def ray_address():
    """The test session's one Ray instance; `molt-train` subprocesses join it with `--ray.address`.
    Its CPUs are logical: every engine and trainer rank a run places takes one, up to 4 here."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def dense_dir():
    from molt_agents.tiny import tiny_model

    return tiny_model("dense")


@pytest.fixture(scope="session")
def moe_dir():
    from molt_agents.tiny import tiny_model

    return tiny_model("moe")


class OneEngineAtATime:
    def __init__(self):
        self.model_dir, self.engine = None, None

    def get(self, model_dir, **kwargs):
        from molt_agents.engines import make_engine

        if self.model_dir != (model_dir, kwargs):
            self.close()
            self.engine = make_engine("vllm", model_dir, **kwargs)
            self.model_dir = (model_dir, kwargs)
        return self.engine

    def close(self):
        if self.engine is not None:
            self.engine.close()
        self.model_dir, self.engine = None, None


@pytest.fixture(scope="session")
def vllm_engines():
    engines = OneEngineAtATime()
    yield engines
    engines.close()


@pytest.fixture
def vllm_dense(vllm_engines, dense_dir):
    return vllm_engines.get(dense_dir)


@pytest.fixture
def vllm_moe(vllm_engines, moe_dir):
    return vllm_engines.get(moe_dir)


def run(coroutine):
    """Run a coroutine to completion from a sync test."""
    return asyncio.run(coroutine)


@contextlib.contextmanager
def molt_serve(*args):
    """`molt-serve *args` as a user starts it (a subprocess): yields its start-up lines (through "API key")
    and its base URL (`.../s/<session>/v1`, as printed); stopped on exit."""
    import re
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "molt_agents.serve", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        while not any(line.startswith("API key") for line in lines):
            line = process.stdout.readline()
            assert line, "molt-serve exited before it printed its key"
            lines.append(line)
        yield lines, re.search(r"base URL: (\S+)", "".join(lines)).group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)


async def long_request(engine, prompt, max_tokens: int):
    """Start a seeded request on `engine` and return its future once its first tokens are sampled
    (so a weight update after this lands mid-request)."""
    from molt_agents.engines import SamplingParams

    loop, started = asyncio.get_running_loop(), asyncio.Event()
    request = asyncio.ensure_future(engine.generate(
        prompt, SamplingParams(max_tokens=max_tokens, seed=1),
        on_tokens=lambda index, progress: loop.call_soon_threadsafe(started.set)))
    await started.wait()
    return request


def live_loopback(vllm_engines, model_dir, max_model_len: int = 512):
    """A live loopback over the session's engine for `model_dir`, on a random port; finished sessions'
    trajectories collect in `.captured`. A generator, for fixtures to yield from."""
    from transformers import AutoTokenizer

    from molt_agents.loopback import Loopback

    captured = []
    server = Loopback(vllm_engines.get(model_dir), AutoTokenizer.from_pretrained(model_dir),
                      max_model_len=max_model_len, on_finish=captured.extend).start()
    server.captured = captured
    yield server
    server.stop()


@pytest.fixture
def loopback(vllm_engines, dense_dir):
    """A live loopback over the session's dense engine."""
    yield from live_loopback(vllm_engines, dense_dir)


def memorize(model_dir, conversations, tools=None, steps=40, lr=3e-2):
    """Fine-tune the tiny model until it reproduces the assistant turns of `conversations`.

    The untrained tiny model emits random tokens; tests that need a policy which
    really writes tool calls train one here, on CPU in seconds, and load it into
    the engine through the real weight-update path. Returns the state dict.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt_agents.chat_template import render_text

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = []
    for messages in conversations:
        ids, labels, done = [], [], ""
        for i, message in enumerate(messages):
            pieces = []
            if message["role"] == "assistant":  # the generation prompt is context
                prompt = render_text(tokenizer, messages[:i], tools, add_generation_prompt=True)
                pieces.append((prompt, False))
            pieces.append((render_text(tokenizer, messages[: i + 1], tools, add_generation_prompt=False),
                           message["role"] == "assistant"))
            for text, trained in pieces:
                piece = tokenizer.encode(text[len(done):], add_special_tokens=False)
                ids += piece
                labels += piece if trained else [-100] * len(piece)
                done = text
        batch.append((torch.tensor([ids]), torch.tensor([labels])))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(0)
    for _ in range(steps):
        for ids, labels in batch:
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
