"""`shapes`: count the shapes in a picture the environment draws itself.

A visual, single-turn task for vision-language policies. Each episode draws
1 to `max_shapes` filled shapes (squares, discs, triangles) in random
colours at random, non-overlapping cells of a grid on a dark background
(PIL, no files); the observation is a chat message with the image and the
question. Reward 1 when the reply's first digit is the count, else 0.
"""

from __future__ import annotations

import re

import numpy as np

from molt_env import Env

COLOURS = [(230, 60, 60), (60, 200, 80), (70, 110, 240), (240, 210, 60), (220, 90, 220)]


def first_digit(reply: str) -> int | None:
    found = re.search(r"\d", reply)
    return int(found.group()) if found else None


def draw(rng: np.random.Generator, count: int, size: int = 56, grid: int = 2):
    """An RGB picture of `count` shapes, each in its own cell of a `grid` x `grid` layout."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (20, 20, 28))
    pen = ImageDraw.Draw(image)
    cell = size // grid
    for index in rng.choice(grid * grid, size=count, replace=False):
        x, y = (index % grid) * cell, (index // grid) * cell
        box = [x + 2, y + 2, x + cell - 3, y + cell - 3]
        colour = COLOURS[int(rng.integers(len(COLOURS)))]
        kind = int(rng.integers(3))
        if kind == 0:
            pen.rectangle(box, fill=colour)
        elif kind == 1:
            pen.ellipse(box, fill=colour)
        else:
            pen.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=colour)
    return image


class Shapes(Env):
    def __init__(self, max_shapes: int = 3, size: int = 56, grid: int = 2):
        self.max_shapes, self.size, self.grid = max_shapes, size, grid

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.count = int(self.np_random.integers(1, self.max_shapes + 1))
        image = draw(self.np_random, self.count, self.size, self.grid)
        message = {"role": "user", "content": [
            {"type": "image", "image": image},
            {"type": "text", "text": "How many shapes are in the picture? Reply with one digit."}]}
        return [message], {"count": self.count}

    def step(self, action: str):
        reward = float(first_digit(action) == self.count)
        return "", reward, True, False, {"count": self.count}
