"""Looser training scenes: one or two shapes of any size, anywhere, so the tower does not learn that objects
only come in two sizes and sit in the middle of their cell. An object's region is the cell its centre falls
in; its size word is "large" from a half-extent of a tenth of the image. Backgrounds stay the generator's
palette (the freeform evaluation images use colours outside it, turned shapes and squashed circles)."""
from __future__ import annotations

import random

import numpy as np
from PIL import Image, ImageDraw

from scenes import BACKGROUNDS, COLOURS, REGIONS, SHAPES, Scene, SceneObject
from scenes.drawing import background_array, draw_object

LARGE_FROM = 0.10


def render_loose(seed: int, size: int = 384) -> Scene:
    rng = random.Random(int(seed) * 6151 + 11)
    tone = rng.choice(list(BACKGROUNDS))
    allowed = [c for c, rgb in COLOURS.items()
               if float(np.linalg.norm(np.subtract(rgb, BACKGROUNDS[tone]))) >= 120.0]
    objects: list[SceneObject] = []
    wanted = rng.choice([1, 2])
    for _ in range(200):  # rejection sampling: centres in different cells, shapes not touching
        if len(objects) == wanted:
            break
        radius = rng.uniform(0.05, 0.32 if not objects else 0.16)
        cx, cy = rng.uniform(radius, 1 - radius), rng.uniform(radius, 1 - radius)
        region = REGIONS[min(2, int(cy * 3)) * 3 + min(2, int(cx * 3))]
        if any(o.region == region or np.hypot(o.cx - cx, o.cy - cy) < o.radius + radius + 0.02 for o in objects):
            continue
        colour = rng.choice([c for c in allowed if all(o.colour != c for o in objects)])
        objects.append(SceneObject(shape=rng.choice(SHAPES), colour=colour,
                                   size="large" if radius >= LARGE_FROM else "small",
                                   cx=cx, cy=cy, region=region, radius=radius))
    objects.sort(key=lambda o: REGIONS.index(o.region))
    big = size * 2
    img = Image.fromarray(background_array("plain", [tone], "vertical", big)).convert("RGB")
    draw = ImageDraw.Draw(img)
    for o in objects:
        draw_object(draw, o, big)
    img = img.resize((size, size), Image.LANCZOS)
    names = ", ".join(f"{o.long_name} {o.region}" for o in objects)
    return Scene(seed=int(seed), image=img, background=tone, objects=objects, word=None,
                 description=f"Shapes on a plain {tone} background: {names}.")
