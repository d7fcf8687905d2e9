"""Disjoint seed ranges (train / val / test) and flat question records over a split."""
from __future__ import annotations

from typing import Iterator

from .render import render_scene
from .vocabulary import QTYPES

# Disjoint seed ranges.
SPLITS = {
    "train": range(0, 1_000_000),
    "val": range(1_000_000, 1_100_000),
    "test": range(2_000_000, 2_100_000),
}


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
