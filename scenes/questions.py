"""Question templates, shared by the per-scene QA drawn at render time (`sample_scene_qa`) and the
exhaustive set for training (`all_qa`), so training asks exactly the phrasings the test split asks."""
from __future__ import annotations

import random

from .records import QA, Scene, SceneObject
from .vocabulary import COLOURS, PLURALS, REGION_PHRASES, SHAPES, article


def _q_colour(o: SceneObject, shape_counts: dict[str, int]) -> QA:
    # the region disambiguates a repeated shape
    if shape_counts[o.shape] == 1:
        return QA(f"What colour is the {o.shape}?", o.colour, "colour")
    return QA(f"What colour is the {o.shape} {REGION_PHRASES[o.region]}?", o.colour, "colour")


def _q_shape(o: SceneObject) -> QA:  # colours are unique in a scene
    return QA(f"What shape is the {o.colour} object?", o.shape, "shape")


def _q_count(shape: str, shape_counts: dict[str, int]) -> QA:
    return QA(f"How many {PLURALS[shape]} are there?", str(shape_counts[shape]), "count")


_TOTAL_QUESTIONS = ("How many objects are there?", "How many shapes are in the image?")


def _q_total(question: str, objects: list[SceneObject]) -> QA:
    return QA(question, str(len(objects)), "count")


def _q_what_in(o: SceneObject) -> QA:
    return QA(f"What is {REGION_PHRASES[o.region]} of the image?", o.name, "position")


def _q_where(o: SceneObject) -> QA:
    return QA(f"Where is the {o.colour} {o.shape}?", o.region, "position")


def _word_questions(word_region: str) -> tuple[str, str]:
    return ("What word is written in the image?",
            f"What word is written {REGION_PHRASES[word_region]} of the image?")


def _q_is_there(colour: str, shape: str, present: set) -> QA:
    return QA(f"Is there {article(colour)} {colour} {shape} in the image?",
              "yes" if (colour, shape) in present else "no", "yesno")


def sample_scene_qa(rng: random.Random, objects: list[SceneObject], word: str | None,
                    word_region: str | None) -> list[QA]:
    """The questions a rendered scene carries: one or two per type, yes/no balanced (one yes, one no)."""
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
