"""`render_scene(seed)`: choose a scene's content from its seed, draw it, describe it, ask about it."""
from __future__ import annotations

import random

from PIL import Image, ImageDraw, ImageFont

from .drawing import background_array, draw_object
from .questions import sample_scene_qa
from .records import Scene, SceneObject
from .vocabulary import (BACKGROUNDS, COLOURS, DARK_BACKGROUNDS, LIGHT_BACKGROUNDS, MIN_CONTRAST, REGION_PHRASES,
                         REGIONS, SHAPES, WORDS)

_SIZE_RADIUS = {"small": 0.22, "large": 0.38}  # half-extent, as a fraction of a cell
_WORD_PROB = 0.4
_SUPERSAMPLE = 2
_NUM_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}


def _contrast(c1, c2) -> float:
    return float(sum((a - b) ** 2 for a, b in zip(c1, c2)) ** 0.5)


def _choose_background(rng: random.Random):
    kind = rng.choices(["plain", "gradient", "two-tone"], weights=[0.5, 0.25, 0.25])[0]
    group = LIGHT_BACKGROUNDS if rng.random() < 0.65 else DARK_BACKGROUNDS
    if kind == "plain":
        tones = [rng.choice(group)]
    else:
        tones = rng.sample(group, 2)
    direction = rng.choice(["vertical", "horizontal"])
    return kind, tones, direction, group is LIGHT_BACKGROUNDS


def _background_phrase(kind: str, tones: list[str], direction: str) -> tuple[str, str]:
    """(short name, phrase for the description)."""
    if kind == "plain":
        return tones[0], f"a plain {tones[0]} background"
    a, b = tones
    if kind == "gradient":
        ends = ("at the top", "at the bottom") if direction == "vertical" else ("on the left", "on the right")
        return (
            f"{a} to {b} gradient",
            f"a background that fades from {a} {ends[0]} to {b} {ends[1]}",
        )
    halves = ("at the top", "at the bottom") if direction == "vertical" else ("on the left", "on the right")
    return (
        f"{a} and {b} split",
        f"a background split into {a} {halves[0]} and {b} {halves[1]}",
    )


def _join(items: list[str]) -> str:
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def render_scene(seed: int, size: int = 384) -> Scene:
    """Draw the scene for ``seed`` (deterministic) at ``size`` x ``size`` pixels."""
    rng = random.Random(int(seed) * 7919 + 17)

    # background, and the object colours that stand out on every tone of it
    kind, tones, direction, light = _choose_background(rng)
    allowed = [
        c for c, rgb in COLOURS.items()
        if all(_contrast(rgb, BACKGROUNDS[t]) >= MIN_CONTRAST for t in tones)
    ]

    # word (takes the whole top or bottom row)
    word = rng.choice(WORDS) if rng.random() < _WORD_PROB else None
    word_row = rng.choice([0, 2]) if word else None
    cells = [(r, c) for r in range(3) for c in range(3) if r != word_row]

    n = rng.randint(1, 5)
    n = min(n, len(allowed), len(cells))
    colours = rng.sample(allowed, n)
    shapes = rng.sample(SHAPES, n)
    if n >= 2 and rng.random() < 0.35:  # repeat a shape so counts go above one
        k = rng.randint(1, min(2, n - 1))
        for j in range(1, k + 1):
            shapes[j] = shapes[0]
        rng.shuffle(shapes)
    chosen = rng.sample(cells, n)

    objects: list[SceneObject] = []
    for (row, col), shape, colour in zip(chosen, shapes, colours):
        sz = rng.choice(["small", "large"])
        rc = _SIZE_RADIUS[sz]
        slack = max(0.0, 0.5 - rc - 0.05)  # keep the object inside its cell
        fx = col + 0.5 + rng.uniform(-slack, slack)
        fy = row + 0.5 + rng.uniform(-slack, slack)
        objects.append(SceneObject(
            shape=shape, colour=colour, size=sz, cx=fx / 3.0, cy=fy / 3.0,
            region=REGIONS[row * 3 + col], radius=rc / 3.0,
        ))
    objects.sort(key=lambda o: REGIONS.index(o.region))  # reading order

    # pixels (drawn at 2x and downsampled for smooth edges)
    big = size * _SUPERSAMPLE
    img = Image.fromarray(background_array(kind, tones, direction, big)).convert("RGB")
    draw = ImageDraw.Draw(img)
    for obj in objects:
        draw_object(draw, obj, big)
    word_colour = None
    word_region = None
    if word:
        word_colour = "black" if light else "white"
        word_region = "top" if word_row == 0 else "bottom"
        font = ImageFont.load_default(size=int(round(0.17 * big)))
        wx = big * (0.5 + rng.uniform(-0.08, 0.08))
        wy = big * (word_row + 0.5) / 3.0
        ink = COLOURS[word_colour]
        draw.text((wx, wy), word, fill=ink, font=font, anchor="mm",
                  stroke_width=max(1, round(0.005 * big)), stroke_fill=ink)
    img = img.resize((size, size), Image.LANCZOS)

    # description
    bg_name, bg_phrase = _background_phrase(kind, tones, direction)
    parts = [f"{o.long_name} {REGION_PHRASES[o.region]}" for o in objects]
    if n == 1:
        description = f"The image shows a single {parts[0][2:]}, set against {bg_phrase}."
    else:
        description = f"The image shows {_NUM_WORDS[n]} shapes on {bg_phrase}: {_join(parts)}."
    if word:
        description += (
            f' The word "{word}" is written in large {word_colour} capital letters'
            f" across the {word_region} of the image."
        )

    qa = sample_scene_qa(rng, objects, word, word_region)
    return Scene(
        seed=int(seed), image=img, background=bg_name, objects=objects, word=word,
        description=description, qa=qa, word_region=word_region,
    )
