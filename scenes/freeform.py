"""Images in a style the scene generator never draws, for checking that a model generalises.

``render_freeform(seed)`` draws ONE shape, anywhere and at any size from a small badge to most of the
frame, turned by a random angle, on a plain background of a random colour outside the generator's palette
(the generator keeps objects inside a 3 x 3 grid of cells, unrotated, two fixed sizes, on ten background
tones). The colour and shape vocabularies are the generator's, so the answers keep their canonical form.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from .drawing import shape_polygon
from .vocabulary import BACKGROUNDS, COLOURS, SHAPES

_SUPERSAMPLE = 2


@dataclass
class FreeformImage:
    seed: int
    image: Image.Image
    shape: str
    colour: str
    background: tuple[int, int, int]
    radius: float  # half-extent, fraction of the side
    centre: tuple[float, float]  # fractions of the side


def _distance(a, b) -> float:
    return math.dist(a, b)


def _background(rng: random.Random, ink: tuple[int, int, int]) -> tuple[int, int, int]:
    while True:
        bg = tuple(rng.randrange(256) for _ in range(3))
        if _distance(bg, ink) >= 140 and all(_distance(bg, t) >= 25 for t in BACKGROUNDS.values()):
            return bg


def _rotated(points, cx: float, cy: float, angle: float):
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + (x - cx) * c - (y - cy) * s, cy + (x - cx) * s + (y - cy) * c) for x, y in points]


def render_freeform(seed: int, size: int = 384) -> FreeformImage:
    rng = random.Random(int(seed) * 104729 + 3)
    shape = rng.choice(SHAPES)
    colour = rng.choice(list(COLOURS))
    bg = _background(rng, COLOURS[colour])
    radius = rng.uniform(0.08, 0.42)
    cx = rng.uniform(radius, 1 - radius)
    cy = rng.uniform(radius, 1 - radius)
    big = size * _SUPERSAMPLE
    img = Image.new("RGB", (big, big), bg)
    draw = ImageDraw.Draw(img)
    x, y, r = cx * big, cy * big, radius * big
    if shape == "circle":
        sx = rng.uniform(0.9, 1.0)  # a slightly squashed circle is still a circle to a person
        draw.ellipse([x - r * sx, y - r, x + r * sx, y + r], fill=COLOURS[colour])
    else:
        angle = math.radians(rng.uniform(-25, 25))
        draw.polygon(_rotated(shape_polygon(shape, x, y, r), x, y, angle), fill=COLOURS[colour])
    img = img.resize((size, size), Image.LANCZOS)
    return FreeformImage(seed=int(seed), image=img, shape=shape, colour=colour, background=bg, radius=radius,
                         centre=(cx, cy))
