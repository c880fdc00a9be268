"""Images on their way into the engine: take them out of chat messages, check them, process them.

Messages carry images as content parts, in order:

    {"type": "image", "image": <PIL.Image or HxWx3 uint8 array>}          an Env observation
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   an OpenAI client

`chat_images` decodes and checks every image (format, size, count; remote
URLs only when allowed); `for_template` turns the parts into the plain
`{"type": "image"}` the chat template renders as one placeholder. `Vision`
wraps the model's own Hugging Face processor: it tokenizes rendered text
with images, expanding each placeholder to the model's image tokens, and
returns the image tensors beside the ids, one dict per image. An image's
span is everything its placeholder expanded to (for Idefics3, the image
tokens with the markers around them); `collapse` turns the spans back into
single placeholders, which is the text the template wrote and the prompt
vLLM takes.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageError(ValueError):
    """A bad image in a request or an observation; the message says which and why."""


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per conversation
    max_bytes: int = 4 << 20  # encoded size of one image
    max_pixels: int = 4096 * 4096  # width * height of one image
    allow_remote: bool = False  # fetch http(s) image URLs


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def chat_images(messages: list[dict], limits: ImageLimits = ImageLimits()) -> list:
    """Every image of `messages`, in order, as RGB PIL images; `ImageError` names a bad one."""
    images = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if is_image_part(part):
                where = f"messages[{i}].content[{j}]"
                images.append(_check_size(_load(part, where, limits), where, limits))
    if len(images) > limits.max_images:
        raise ImageError(f"{len(images)} images in the conversation; at most {limits.max_images}")
    return images


def for_template(messages: list[dict]) -> list[dict]:
    """`messages` with image parts reduced to `{"type": "image"}` (the template renders a placeholder)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            message = {**message, "content": [{"type": "image"} if is_image_part(p) else p for p in content]}
        out.append(message)
    return out


def _load(part: dict, where: str, limits: ImageLimits):
    from PIL import Image

    if part["type"] == "image":
        image = part.get("image")
        if isinstance(image, np.ndarray):
            if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in (3, 4):
                raise ImageError(f"{where}: an image array must be uint8 HxWx3 (or 4), got {image.dtype} {image.shape}")
            return Image.fromarray(image).convert("RGB")
        if isinstance(image, Image.Image):
            return image.convert("RGB")
        raise ImageError(f"{where}: 'image' must be a PIL image or a uint8 array, got {type(image).__name__}")
    url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
    if not isinstance(url, str):
        raise ImageError(f"{where}: image_url needs {{'url': ...}}")
    if url.startswith(("http://", "https://")):
        if not limits.allow_remote:
            raise ImageError(f"{where}: remote image URLs are not fetched (allow them: molt-serve --allow-remote-images, "
                             "molt-train --rollout.allow_remote_images true); "
                             "send the image inline as a data: URL")
        data = _fetch(url, limits, where)
    elif url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ImageError(f"{where}: a data: URL must be base64 (data:image/png;base64,...)")
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise ImageError(f"{where}: the image is over {limits.max_bytes >> 20} MiB")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f"{where}: the data: URL is not valid base64") from None
    else:
        raise ImageError(f"{where}: unsupported image URL {url[:40]!r}; use a data: URL")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception:
        raise ImageError(f"{where}: the bytes are not an image (corrupt or truncated)") from None
    if image.format not in FORMATS:
        raise ImageError(f"{where}: unsupported image format {image.format}; use one of {', '.join(FORMATS)}")
    return image.convert("RGB")


def _fetch(url: str, limits: ImageLimits, where: str) -> bytes:
    import httpx

    data = bytearray()
    try:
        with httpx.stream("GET", url, timeout=10.0, follow_redirects=True) as response:
            response.raise_for_status()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > limits.max_bytes:  # stop reading: never hold more than the limit
                    raise ImageError(f"{where}: the image is over {limits.max_bytes >> 20} MiB")
    except httpx.HTTPError as error:
        raise ImageError(f"{where}: could not fetch {url}: {error}") from None
    return bytes(data)


def _check_size(image, where: str, limits: ImageLimits):
    if image.width * image.height > limits.max_pixels:
        raise ImageError(f"{where}: {image.width}x{image.height} is over {limits.max_pixels} pixels")
    return image


class Vision:
    """The model's processor: text with image placeholders in, token ids and per-image tensors out."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.tokenizer = self.processor.tokenizer
        self.image_token = self.processor.image_token  # what the chat template writes for an image
        self.placeholder_id = self.tokenizer.convert_tokens_to_ids(self.image_token)

    @staticmethod
    def available(model_dir: str | Path) -> bool:
        """Whether `model_dir` is a vision-language model with a processor."""
        import json

        config = Path(model_dir) / "config.json"
        return config.exists() and "vision_config" in json.loads(config.read_text())

    def encode(self, text: str, images: list) -> tuple[list[int], list[list[int]], list[dict[str, np.ndarray]]]:
        """Token ids of `text` with each image placeholder expanded; each image's span `[start, length]`
        of expanded tokens in those ids; each image's tensors.

        The processor expands one image at a time (each image is processed once), and the text between
        placeholders is tokenized on its own: the placeholder is a special token, at which the tokenizer
        splits anyway, so the ids are the ones the processor gives for the whole text.
        """
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"{len(pieces) - 1} image placeholders for {len(images)} images")
        ids = self.tokenizer.encode(pieces[0], add_special_tokens=False)
        spans, tensors = [], []
        for image, piece in zip(images, pieces[1:]):
            out = self.processor(text=[self.image_token], images=[image], return_tensors="np",
                                 add_special_tokens=False)
            expansion = [int(t) for t in out["input_ids"][0]]
            spans.append([len(ids), len(expansion)])
            tensors.append({k: np.asarray(v) for k, v in out.items() if k not in ("input_ids", "attention_mask")})
            ids += expansion + self.tokenizer.encode(piece, add_special_tokens=False)
        return ids, spans, tensors


def collapse(token_ids: list[int], spans: list[list[int]], placeholder_id: int) -> list[int]:
    """`token_ids` with each image's expanded span back to the one placeholder the chat template writes."""
    ids, cursor = [], 0
    for start, length in spans:
        ids += token_ids[cursor:start] + [placeholder_id]
        cursor = start + length
    return ids + token_ids[cursor:]


def image_axis(tensors: dict[str, np.ndarray]) -> int:
    """The axis along which a sequence's images lie in a processor's tensors. Processors whose
    `pixel_values` are [batch, images, C, H, W] (Idefics3, SmolVLM; its `pixel_attention_mask` is
    [batch, images, H, W]) lead every tensor with a batch axis: images go along axis 1, a sequence's
    and a batch's alike, row after row. The rest (LLaVA [images, C, H, W], Qwen-VL's patches) use axis 0."""
    pixels = tensors.get("pixel_values")
    return 1 if pixels is not None and pixels.ndim >= 5 else 0


def join_images(images: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-image tensors as one set of forward arguments, images in placeholder order."""
    if not images:
        return {}
    axis = image_axis(images[0])
    return {name: np.concatenate([image[name] for image in images], axis=axis) for name in images[0]}


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images, for an engine: the pictures (for one that runs the model's processor itself,
    vLLM), the processor's tensors (for one that does not, transformers), and each image's span of
    expanded tokens in the prompt."""

    pictures: list  # RGB PIL images, in order
    spans: list[list[int]]
    placeholder_id: int
    per_image: list[dict[str, np.ndarray]]  # each image's processor tensors

    @cached_property
    def tensors(self) -> dict[str, np.ndarray]:
        """The forward's image arguments (joined only for an engine that asks: vLLM never does)."""
        return join_images(self.per_image)

    def collapsed(self, token_ids: list[int]) -> list[int]:
        """The prompt with one placeholder per image, as an engine that expands them itself takes it."""
        return collapse(token_ids, self.spans, self.placeholder_id)
