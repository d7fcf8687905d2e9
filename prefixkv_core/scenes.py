"""Seeded synthetic scenes with known content, for quality checks without a data set.

``render_scene(seed)`` draws 1-5 coloured shapes on a plain, two-tone or gradient
background, sometimes (about 40%) with a short printed word, and returns the
image together with a ground-truth description and question/answer pairs.
The same seed always gives the same pixels and the same text (Pillow only; no
torch, no font files: the text uses Pillow's bundled default font).

Layout: the image is a 3 x 3 grid of regions ("top-left", "top", "top-right",
"left", "centre", "right", "bottom-left", "bottom", "bottom-right"). Each object
sits in its own cell (jittered inside it), so objects never overlap and every
object has exactly one region. A word takes a whole top or bottom row. Within a
scene colours are distinct, so "the red object" and "a red circle" are always
unambiguous; shapes may repeat (so "how many circles?" can be 2 or 3).
Objects are large enough to read at 192 x 192 (small ones are ~28 px across
there, large ones ~49 px, words ~23 px tall).

Answers are short and canonical: a colour name ("red"), a shape name
("circle"), a digit ("3"), a region name ("top-left"), "a blue circle", the
word as printed ("STOP"), "yes" / "no".
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
from PIL import Image, ImageDraw, ImageFont

__all__ = [
    "SHAPES",
    "COLOURS",
    "BACKGROUNDS",
    "REGIONS",
    "WORDS",
    "QTYPES",
    "SPLITS",
    "SceneObject",
    "QA",
    "Scene",
    "render_scene",
    "all_qa",
    "split_seeds",
    "scene_samples",
]

SHAPES = ("circle", "square", "triangle", "star", "diamond", "cross")
PLURALS = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "star": "stars",
    "diamond": "diamonds",
    "cross": "crosses",
}

COLOURS = {
    "red": (220, 30, 35),
    "green": (30, 160, 60),
    "blue": (30, 75, 225),
    "yellow": (250, 215, 0),
    "purple": (135, 45, 185),
    "orange": (255, 130, 0),
    "white": (255, 255, 255),
    "black": (20, 20, 20),
}

# Background tones, grouped by lightness so that two-tone and gradient
# backgrounds take one printed-word colour (black on light, white on dark).
BACKGROUNDS = {
    "light grey": (205, 205, 205),
    "cream": (242, 234, 210),
    "pale blue": (190, 215, 240),
    "pale green": (200, 230, 195),
    "pink": (245, 205, 215),
    "sand": (225, 200, 150),
    "dark grey": (60, 60, 60),
    "navy": (25, 35, 80),
    "dark teal": (20, 80, 85),
    "dark brown": (70, 45, 30),
}
_LIGHT = ("light grey", "cream", "pale blue", "pale green", "pink", "sand")
_DARK = ("dark grey", "navy", "dark teal", "dark brown")
_MIN_CONTRAST = 120.0  # Euclidean RGB distance between an object and every background tone

WORDS = (
    "CAT", "DOG", "SUN", "MOON", "STOP", "GO", "OPEN", "BOOK", "TREE", "FISH",
    "BIRD", "CAKE", "RAIN", "SNOW", "HOME", "LOVE", "PLAY", "JUMP", "FROG", "LAMP",
    "MILK", "SHIP", "KING", "ROSE", "WIND", "GOLD", "DOOR", "HAT", "BUS", "MAP",
    "EXIT", "HELLO",
)

# (row, col) -> region name, and how a sentence says "in that region".
REGIONS = (
    "top-left", "top", "top-right",
    "left", "centre", "right",
    "bottom-left", "bottom", "bottom-right",
)
_REGION_PHRASE = {
    "top-left": "in the top-left corner",
    "top": "at the top",
    "top-right": "in the top-right corner",
    "left": "on the left",
    "centre": "in the centre",
    "right": "on the right",
    "bottom-left": "in the bottom-left corner",
    "bottom": "at the bottom",
    "bottom-right": "in the bottom-right corner",
}

QTYPES = ("colour", "shape", "count", "position", "word", "yesno")

# Disjoint seed ranges.
SPLITS = {
    "train": range(0, 1_000_000),
    "val": range(1_000_000, 1_100_000),
    "test": range(2_000_000, 2_100_000),
}

_SIZE_RADIUS = {"small": 0.22, "large": 0.38}  # half-extent, as a fraction of a cell
_WORD_PROB = 0.4
_SUPERSAMPLE = 2
_NUM_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}


@dataclass
class SceneObject:
    shape: str
    colour: str
    size: str  # "small" | "large"
    cx: float  # centre, fraction of the width (0..1)
    cy: float  # centre, fraction of the height (0..1)
    region: str  # one of REGIONS
    radius: float = 0.0  # half-extent, fraction of the image side

    @property
    def name(self) -> str:
        """'a blue circle' / 'an orange star' (the canonical answer form)."""
        return f"{_article(self.colour)} {self.colour} {self.shape}"

    @property
    def long_name(self) -> str:
        return f"a {self.size} {self.colour} {self.shape}"


@dataclass
class QA:
    question: str
    answer: str
    qtype: str  # one of QTYPES


@dataclass
class Scene:
    seed: int
    image: Image.Image
    background: str
    objects: list[SceneObject]
    word: str | None
    description: str
    qa: list[QA] = field(default_factory=list)
    word_region: str | None = None  # "top" | "bottom" when a word is printed


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def _contrast(c1, c2) -> float:
    return float(sum((a - b) ** 2 for a, b in zip(c1, c2)) ** 0.5)


# ---------------------------------------------------------------------------
# drawing


def _background_array(kind: str, tones: list[str], direction: str, size: int) -> np.ndarray:
    a = np.array(BACKGROUNDS[tones[0]], dtype=np.float32)
    if kind == "plain":
        return np.broadcast_to(a, (size, size, 3)).astype(np.uint8)
    b = np.array(BACKGROUNDS[tones[1]], dtype=np.float32)
    if kind == "gradient":
        t = np.linspace(0.0, 1.0, size, dtype=np.float32)
    else:  # two-tone split in the middle
        t = (np.arange(size) >= size // 2).astype(np.float32)
    if direction == "vertical":  # varies from top to bottom
        t = t[:, None, None]
    else:  # varies from left to right
        t = t[None, :, None]
    arr = a * (1 - t) + b * t
    return np.broadcast_to(arr, (size, size, 3)).round().astype(np.uint8)


def _shape_polygon(shape: str, x: float, y: float, r: float) -> list[tuple[float, float]] | None:
    if shape == "square":
        h = r * 0.85
        return [(x - h, y - h), (x + h, y - h), (x + h, y + h), (x - h, y + h)]
    if shape == "triangle":
        yc = y + r * 0.12  # optical centring
        return [
            (x + r * np.cos(a), yc + r * np.sin(a))
            for a in np.deg2rad([-90.0, 30.0, 150.0])
        ]
    if shape == "star":
        pts = []
        for i in range(10):
            rad = r if i % 2 == 0 else r * 0.45
            a = np.deg2rad(-90.0 + 36.0 * i)
            pts.append((x + rad * np.cos(a), y + 0.05 * r + rad * np.sin(a)))
        return pts
    if shape == "diamond":
        return [(x, y - r), (x + 0.72 * r, y), (x, y + r), (x - 0.72 * r, y)]
    if shape == "cross":
        t = r * 0.33
        return [
            (x - t, y - r), (x + t, y - r), (x + t, y - t), (x + r, y - t),
            (x + r, y + t), (x + t, y + t), (x + t, y + r), (x - t, y + r),
            (x - t, y + t), (x - r, y + t), (x - r, y - t), (x - t, y - t),
        ]
    return None


def _draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject, side: int) -> None:
    x, y, r = obj.cx * side, obj.cy * side, obj.radius * side
    fill = COLOURS[obj.colour]
    if obj.shape == "circle":
        draw.ellipse([x - r, y - r, x + r, y + r], fill=fill)
    else:
        pts = _shape_polygon(obj.shape, x, y, r)
        draw.polygon([(float(px), float(py)) for px, py in pts], fill=fill)


# ---------------------------------------------------------------------------
# the scene


def _choose_background(rng: random.Random):
    kind = rng.choices(["plain", "gradient", "two-tone"], weights=[0.5, 0.25, 0.25])[0]
    group = _LIGHT if rng.random() < 0.65 else _DARK
    if kind == "plain":
        tones = [rng.choice(group)]
    else:
        tones = rng.sample(group, 2)
    direction = rng.choice(["vertical", "horizontal"])
    return kind, tones, direction, group is _LIGHT


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
        if all(_contrast(rgb, BACKGROUNDS[t]) >= _MIN_CONTRAST for t in tones)
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
    img = Image.fromarray(_background_array(kind, tones, direction, big)).convert("RGB")
    draw = ImageDraw.Draw(img)
    for obj in objects:
        _draw_object(draw, obj, big)
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
    parts = [f"{o.long_name} {_REGION_PHRASE[o.region]}" for o in objects]
    if n == 1:
        description = f"The image shows a single {parts[0][2:]}, set against {bg_phrase}."
    else:
        description = f"The image shows {_NUM_WORDS[n]} shapes on {bg_phrase}: {_join(parts)}."
    if word:
        description += (
            f' The word "{word}" is written in large {word_colour} capital letters'
            f" across the {word_region} of the image."
        )

    qa = _make_qa(rng, objects, word, word_region)
    return Scene(
        seed=int(seed), image=img, background=bg_name, objects=objects, word=word,
        description=description, qa=qa, word_region=word_region,
    )


# Question templates, shared by the per-scene QA (``_make_qa``) and the exhaustive set for training
# (``all_qa``), so training asks exactly the phrasings the test split asks.


def _q_colour(o: SceneObject, shape_counts: dict[str, int]) -> QA:
    # the region disambiguates a repeated shape
    if shape_counts[o.shape] == 1:
        return QA(f"What colour is the {o.shape}?", o.colour, "colour")
    return QA(f"What colour is the {o.shape} {_REGION_PHRASE[o.region]}?", o.colour, "colour")


def _q_shape(o: SceneObject) -> QA:  # colours are unique in a scene
    return QA(f"What shape is the {o.colour} object?", o.shape, "shape")


def _q_count(shape: str, shape_counts: dict[str, int]) -> QA:
    return QA(f"How many {PLURALS[shape]} are there?", str(shape_counts[shape]), "count")


_TOTAL_QUESTIONS = ("How many objects are there?", "How many shapes are in the image?")


def _q_total(question: str, objects: list[SceneObject]) -> QA:
    return QA(question, str(len(objects)), "count")


def _q_what_in(o: SceneObject) -> QA:
    return QA(f"What is {_REGION_PHRASE[o.region]} of the image?", o.name, "position")


def _q_where(o: SceneObject) -> QA:
    return QA(f"Where is the {o.colour} {o.shape}?", o.region, "position")


def _word_questions(word_region: str) -> tuple[str, str]:
    return ("What word is written in the image?",
            f"What word is written {_REGION_PHRASE[word_region]} of the image?")


def _q_is_there(colour: str, shape: str, present: set) -> QA:
    return QA(f"Is there {_article(colour)} {colour} {shape} in the image?",
              "yes" if (colour, shape) in present else "no", "yesno")


def _make_qa(rng: random.Random, objects: list[SceneObject], word: str | None,
             word_region: str | None) -> list[QA]:
    qa: list[QA] = []
    shape_counts = {s: sum(o.shape == s for o in objects) for s in SHAPES}
    qa.append(_q_colour(rng.choice(objects), shape_counts))
    qa.append(_q_shape(rng.choice(objects)))

    # counts: one shape (sometimes absent), then all objects
    if rng.random() < 0.2:
        s = rng.choice([s for s in SHAPES if shape_counts[s] == 0] or list(SHAPES))
    else:
        s = rng.choice(objects).shape
    qa.append(_q_count(s, shape_counts))
    qa.append(_q_total(rng.choice(_TOTAL_QUESTIONS), objects))

    # position: what is in a region / where is an object
    qa.append(_q_what_in(rng.choice(objects)))
    qa.append(_q_where(rng.choice(objects)))

    if word:
        qa.append(QA(rng.choice(_word_questions(word_region)), word, "word"))

    # yes/no: exactly one yes and one no per scene
    present = {(o.colour, o.shape) for o in objects}
    o = rng.choice(objects)
    qa.append(_q_is_there(o.colour, o.shape, present))
    if rng.random() < 0.5:  # hard negative: a colour that is there, on another shape
        c = rng.choice(objects).colour
        s = rng.choice([s for s in SHAPES if (c, s) not in present])
    else:
        options = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in present]
        c, s = rng.choice(options)
    qa.append(_q_is_there(c, s, present))
    return qa


def all_qa(scene: Scene, rng: random.Random, negatives: int = 3) -> list[QA]:
    """Every question the templates can ask about ``scene`` (for training: one image, many answers).

    Per object: its colour, its shape, what is in its region, where it is, "is there <it>?" (yes).
    Counts of every shape present plus one absent shape, the total (both phrasings), the word (both
    phrasings), and ``negatives`` "is there ...?" questions answered no, half of them hard (a colour
    that is present, on another shape).
    """
    objects = scene.objects
    shape_counts = {s: sum(o.shape == s for o in objects) for s in SHAPES}
    present = {(o.colour, o.shape) for o in objects}
    qa: list[QA] = []
    for o in objects:
        qa += [_q_colour(o, shape_counts), _q_shape(o), _q_what_in(o), _q_where(o),
               _q_is_there(o.colour, o.shape, present)]
    for s in SHAPES:
        if shape_counts[s]:
            qa.append(_q_count(s, shape_counts))
    absent = [s for s in SHAPES if shape_counts[s] == 0]
    if absent:
        qa.append(_q_count(rng.choice(absent), shape_counts))
    qa += [_q_total(q, objects) for q in _TOTAL_QUESTIONS]
    if scene.word:
        qa += [QA(q, scene.word, "word") for q in _word_questions(scene.word_region)]
    hard = [(o.colour, s) for o in objects for s in SHAPES if (o.colour, s) not in present]
    anywhere = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in present]
    for i in range(negatives):
        c, s = rng.choice(hard if i % 2 == 0 else anywhere)
        qa.append(_q_is_there(c, s, present))
    return qa


# ---------------------------------------------------------------------------
# splits and flat samples


def split_seeds(split: str, n: int) -> list[int]:
    """The first ``n`` seeds of a split (train / val / test: disjoint ranges)."""
    if split not in SPLITS:
        raise KeyError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    rng_ = SPLITS[split]
    if n < 0 or n > len(rng_):
        raise ValueError(f"split {split!r} has {len(rng_)} seeds, asked for {n}")
    return list(rng_[:n])


def scene_samples(split: str, n: int, size: int = 384, per_scene: int | None = 1,
                  qtypes: tuple[str, ...] | None = None) -> Iterator[dict]:
    """Flat records ``{"id", "seed", "image", "question", "answer", "qtype", "description"}``.

    ``n`` is the number of scenes (seeds ``split_seeds(split, n)``). With
    ``per_scene=1`` (default) each scene gives one record and the question types
    rotate over the scenes (``colour, shape, count, position, word, yesno, ...``;
    a scene without a word gives the next type instead), so ``n`` records cover
    every type evenly. ``per_scene=None`` gives every QA pair of every scene,
    ``per_scene=k`` the first ``k`` of the rotation. ``qtypes`` restricts the
    types. Records of one scene share one image object.
    """
    types = tuple(qtypes) if qtypes else QTYPES
    for t in types:
        if t not in QTYPES:
            raise ValueError(f"unknown qtype {t!r}")
    for i, seed in enumerate(split_seeds(split, n)):
        scene = render_scene(seed, size)
        pool = [qa for qa in scene.qa if qa.qtype in types]
        if per_scene is None:
            picked = pool
        else:
            # rotate the starting type with the scene index, then round-robin
            order = [types[(i + j) % len(types)] for j in range(len(types))]
            by_type = {t: [qa for qa in pool if qa.qtype == t] for t in order}
            picked = []
            depth = 0
            while len(picked) < min(per_scene, len(pool)):
                for t in order:
                    if depth < len(by_type[t]) and len(picked) < per_scene:
                        picked.append(by_type[t][(depth + seed) % len(by_type[t])])
                depth += 1
        for j, qa in enumerate(picked):
            yield {
                "id": f"{split}-{seed}-{j}",
                "seed": seed,
                "image": scene.image,
                "question": qa.question,
                "answer": qa.answer,
                "qtype": qa.qtype,
                "description": scene.description,
            }
