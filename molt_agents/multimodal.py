"""Images on their way into the engine: take them out of chat messages, check them, process them.

Messages carry images as content parts, in order:

    {"type": "image", "image": <PIL.Image or HxWx3 uint8 array>}          an Env observation
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   an OpenAI client

`chat_images` decodes and checks every image (format, size, count; remote
URLs only when allowed); `for_template` turns the parts into the plain
`{"type": "image"}` the chat template renders as one placeholder. `Vision`
wraps the model's own Hugging Face processor: it tokenizes rendered text
with images, expanding each placeholder to the model's image tokens, and
returns the image tensors beside the ids, one dict per image.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
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
        self.placeholder_id = self.tokenizer.convert_tokens_to_ids(self.processor.image_token)

    @staticmethod
    def available(model_dir: str | Path) -> bool:
        """Whether `model_dir` is a vision-language model with a processor."""
        import json

        config = Path(model_dir) / "config.json"
        return config.exists() and "vision_config" in json.loads(config.read_text())

    def encode(self, text: str, images: list) -> tuple[list[int], list[dict[str, np.ndarray]]]:
        """Token ids of `text` with each placeholder expanded, and the tensors of each image."""
        if not images:
            return self.tokenizer.encode(text, add_special_tokens=False), []
        out = self.processor(text=[text], images=images, return_tensors="np", add_special_tokens=False)
        tensors = {k: np.asarray(v) for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        return [int(t) for t in out["input_ids"][0]], split_images(tensors, len(images))


def split_images(tensors: dict[str, np.ndarray], count: int) -> list[dict[str, np.ndarray]]:
    """One batch of processor tensors as one dict per image (rows per image: 1, or its grid's patches)."""
    grid = tensors.get("image_grid_thw")
    sizes = [int(np.prod(row)) for row in grid] if grid is not None else [len(tensors["pixel_values"]) // count] * count
    edges = np.cumsum([0] + sizes)
    per_image = []
    for i in range(count):
        image = {}
        for name, value in tensors.items():
            if name == "pixel_values":
                image[name] = value[edges[i]: edges[i + 1]]
            else:
                image[name] = value[i: i + 1]
        per_image.append(image)
    return per_image


def join_images(images: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-image tensors back into one batch (the forward's keyword arguments)."""
    return {name: np.concatenate([image[name] for image in images]) for name in images[0]} if images else {}
