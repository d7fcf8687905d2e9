"""Multi-image samples built from rendered scenes: several images, one question that needs all of them.

``multi_sample(seed)`` shows 2-6 scenes and asks one of four kinds of question (``MULTI_SUBTASKS``):

- ``which``: "Which image shows a red circle?" -> "2" (exactly one image holds that colour and shape);
- ``colour_k``: "What colour is the circle in image 3?" -> "blue" (one circle in image 3; another image has a
  circle of another colour, so the answer needs the right image);
- ``needle``: "Which word is printed in one of the images?" -> "STOP" (exactly one image has a word);
- ``count``: "How many circles are there in all the images?" -> "4" (totals 1-9).

Images are numbered from 1 in the order they are shown; ``MultiSample.prompt`` says so before the question.

Seeds. A sample seed lies in one of ``scenes.splits.SPLITS``' ranges and its images are scenes of that same
split. With ``start`` and ``length`` the split's range, the sample's index is ``seed - start``; its subtask is
``MULTI_SUBTASKS[index % 4]``; its number of images, when not given, is drawn from the seed (2-6). The j-th
candidate scene of the sample is ``start + splitmix64(splitmix64(seed) ^ j) % length`` (j = 0, 1, 2, ...):
candidates are taken in that order and kept or passed over by the subtask's rule (a deterministic rejection; a
scene already taken is passed over too), so every image of a test sample is a test-split scene, no scene shows
twice, and the same seed always gives the same scenes. ``MultiSample.scene_seeds`` lists them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from PIL import Image

from .grading import is_correct, is_correct_image_number
from .records import Scene
from .render import render_scene
from .splits import SPLITS
from .vocabulary import PLURALS, SHAPES, article

MULTI_SUBTASKS = ("which", "colour_k", "needle", "count")
MIN_IMAGES, MAX_IMAGES = 2, 6
MAX_COUNT = 9  # the count subtask's totals stay single digits
_PROBE_SIZE = 32  # a scene's content does not depend on its size: candidates are checked at a small one
_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output function (a 64-bit integer hash)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def split_of(seed: int) -> str:
    """The split whose seed range holds ``seed`` (ValueError outside every range)."""
    for name, rng_ in SPLITS.items():
        if seed in rng_:
            return name
    raise ValueError(f"seed {seed} lies in no split's range ({', '.join(f'{k}: {v}' for k, v in SPLITS.items())})")


def subtask_of(seed: int, subtasks: tuple[str, ...]) -> str:
    """The subtask of a sample seed: they rotate with the seed's index in its split."""
    return subtasks[(seed - SPLITS[split_of(seed)].start) % len(subtasks)]


def candidate_seeds(seed: int) -> Iterator[int]:
    """The scene seeds a sample draws from, in order (all in the sample seed's split)."""
    rng_ = SPLITS[split_of(seed)]
    base = splitmix64(seed & _MASK)
    j = 0
    while True:
        yield rng_.start + splitmix64(base ^ j) % len(rng_)
        j += 1


@dataclass(frozen=True)
class MultiSample:
    seed: int
    split: str
    subtask: str  # one of MULTI_SUBTASKS
    scene_seeds: tuple[int, ...]  # the images' scenes, in the order shown
    question: str
    answer: str
    target: int | None  # the image (from 1) that holds the answer; None for count
    images: tuple[Image.Image, ...] = ()

    @property
    def n_images(self) -> int:
        return len(self.scene_seeds)

    @property
    def prompt(self) -> str:
        """The question as asked with the images: how they are numbered, then the question."""
        return multi_prompt(self.question, self.n_images)

    def grade(self, output: str) -> bool:
        return grade(output, self.answer, self.subtask)

    def record(self) -> dict:
        """A flat record for JSON: the seed rebuilds the images."""
        return {"id": f"{self.split}-{self.seed}", "seed": self.seed, "question": self.question,
                "answer": self.answer, "subtask": self.subtask, "n_images": self.n_images,
                "scene_seeds": list(self.scene_seeds)}


def numbering_note(n_images: int) -> str:
    return f"There are {n_images} images, numbered 1 to {n_images} in the order they are shown."


def multi_prompt(question: str, n_images: int) -> str:
    """What is asked with the images: the numbering note, then the question."""
    return numbering_note(n_images) + " " + question


def grade(output: str, answer: str, subtask: str) -> bool:
    """``which`` answers are an image number ("2", "Image 2"); the others are graded by ``is_correct``."""
    return is_correct_image_number(output, answer) if subtask == "which" else is_correct(output, answer)


class _Candidates:
    """The sample's candidate scenes (content only, rendered small), taken in order; a scene seed already
    taken is passed over, so a sample never shows one scene twice."""

    def __init__(self, seed: int):
        self._seeds = candidate_seeds(seed)
        self._taken: set[int] = set()

    def next(self, keep=lambda scene: True) -> Scene:
        while True:
            seed = next(self._seeds)
            if seed in self._taken:
                continue
            scene = render_scene(seed, _PROBE_SIZE)
            if keep(scene):
                self._taken.add(seed)
                return scene


def _pairs(scene: Scene) -> set[tuple[str, str]]:
    return {(o.colour, o.shape) for o in scene.objects}


def _shape_count(scene: Scene, shape: str) -> int:
    return sum(o.shape == shape for o in scene.objects)


def _place(target: Scene, others: list[Scene], k: int) -> list[Scene]:
    return others[:k] + [target] + others[k:]


def _which(rng: random.Random, cands: _Candidates, n: int):
    target = cands.next()
    colour, shape = rng.choice(sorted(_pairs(target)))
    others = [cands.next(lambda s: (colour, shape) not in _pairs(s)) for _ in range(n - 1)]
    k = rng.randrange(n)
    question = f"Which image shows {article(colour)} {colour} {shape}?"
    return _place(target, others, k), question, str(k + 1), k + 1


def _colour_k(rng: random.Random, cands: _Candidates, n: int):
    target = cands.next(lambda s: any(_shape_count(s, o.shape) == 1 for o in s.objects))
    obj = rng.choice([o for o in target.objects if _shape_count(target, o.shape) == 1])
    # a distractor: the same shape in another colour, elsewhere in the set
    distractor = cands.next(lambda s: any(o.shape == obj.shape and o.colour != obj.colour for o in s.objects))
    others = [distractor] + [cands.next() for _ in range(n - 2)]
    rng.shuffle(others)
    k = rng.randrange(n)
    question = f"What colour is the {obj.shape} in image {k + 1}?"
    return _place(target, others, k), question, obj.colour, k + 1


def _needle(rng: random.Random, cands: _Candidates, n: int):
    target = cands.next(lambda s: s.word is not None)
    others = [cands.next(lambda s: s.word is None) for _ in range(n - 1)]
    k = rng.randrange(n)
    return _place(target, others, k), "Which word is printed in one of the images?", target.word, k + 1


def _count(rng: random.Random, cands: _Candidates, n: int):
    shape = rng.choice(SHAPES)
    while True:
        scenes = [cands.next() for _ in range(n)]
        total = sum(_shape_count(s, shape) for s in scenes)
        if 1 <= total <= MAX_COUNT:
            return scenes, f"How many {PLURALS[shape]} are there in all the images?", str(total), None


_BUILDERS = {"which": _which, "colour_k": _colour_k, "needle": _needle, "count": _count}


def _choose(seed: int, n_images: int | None):
    split = split_of(seed)
    subtask = subtask_of(seed, MULTI_SUBTASKS)
    rng = random.Random(splitmix64(seed ^ 0x6D756C7469))
    n = rng.randint(MIN_IMAGES, MAX_IMAGES)
    if n_images is not None:
        if not MIN_IMAGES <= n_images <= MAX_IMAGES:
            raise ValueError(f"n_images must be {MIN_IMAGES}-{MAX_IMAGES}, got {n_images}")
        n = n_images
    scenes, question, answer, target = _BUILDERS[subtask](rng, _Candidates(seed), n)
    return split, subtask, tuple(s.seed for s in scenes), question, answer, target


def multi_sample(seed: int, n_images: int | None = None, size: int = 384, images: bool = True) -> MultiSample:
    """The sample for ``seed`` (deterministic). ``images=False`` skips the pixels (the text and scene seeds are
    the same)."""
    split, subtask, scene_seeds, question, answer, target = _choose(int(seed), n_images)
    pixels = tuple(render_scene(s, size).image for s in scene_seeds) if images else ()
    return MultiSample(seed=int(seed), split=split, subtask=subtask, scene_seeds=scene_seeds, question=question,
                       answer=answer, target=target, images=pixels)


def multi_seeds(split: str, n: int, subtask: str | None = None) -> list[int]:
    """The first ``n`` sample seeds of ``split`` (of one subtask when given): index 0, 1, ... of the range."""
    if split not in SPLITS:
        raise KeyError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    start, step = SPLITS[split].start, 1
    if subtask is not None:
        if subtask not in MULTI_SUBTASKS:
            raise ValueError(f"unknown subtask {subtask!r}; expected one of {MULTI_SUBTASKS}")
        start, step = start + MULTI_SUBTASKS.index(subtask), len(MULTI_SUBTASKS)
    return [start + i * step for i in range(n)]


def multi_samples(split: str, n: int, subtask: str | None = None, n_images: int | None = None, size: int = 384,
                  images: bool = True) -> Iterator[MultiSample]:
    """The split's first ``n`` samples (of one subtask when given), in seed order."""
    for seed in multi_seeds(split, n, subtask):
        yield multi_sample(seed, n_images, size, images)


def multi_records(split: str, n: int, subtask: str | None = None) -> list[dict]:
    """Flat records (``MultiSample.record``) of ``multi_samples``, without rendering the images."""
    return [s.record() for s in multi_samples(split, n, subtask, images=False)]
