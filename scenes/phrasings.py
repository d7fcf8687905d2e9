"""Questions as people type them, beside the templates' canonical wording.

Two disjoint sets of phrasings per question type: ``TRAIN`` phrasings may be used to teach a model, ``HELD_OUT``
phrasings are only ever asked in evaluation, so a model that answers them has learnt the question, not the
sentence. Each phrasing is a format string over the scene's facts; the answers are the canonical ones
(``scenes.questions``), so one scoring rule serves both.
"""
from __future__ import annotations

import random

from .records import QA, Scene
from .vocabulary import PLURALS, REGION_PHRASES, SHAPES

# {shape} / {colour} / {plural} / {where} (a region phrase) are filled from the scene.
TRAIN = {
    "colour": ("What color is the {shape}?", "what colour is the {shape}", "Which colour is the {shape}?",
               "Tell me the color of the {shape}.", "What's the colour of the {shape}?", "the {shape} is what color?"),
    "shape": ("What shape is the {colour} thing?", "Which shape is {colour}?", "what is the {colour} shape",
              "Name the shape that is {colour}.", "What kind of shape is {colour}?"),
    "count": ("How many {plural} do you see?", "how many {plural} are in the picture", "Count the {plural}.",
              "Number of {plural}?"),
    "total": ("How many shapes do you see?", "count the objects", "How many things are in the picture?"),
    "position": ("Where's the {colour} {shape}?", "where is the {colour} {shape} located",
                 "In which part of the image is the {colour} {shape}?"),
    "what_in": ("What do you see {where}?", "what's {where}", "Which object is {where}?"),
    "word": ("What does the text say?", "Read the word in the image.", "what word do you see"),
    "yesno": ("Do you see {a} {colour} {shape}?", "is there {a} {colour} {shape}",
              "Can you find {a} {colour} {shape} in the picture?"),
}
HELD_OUT = {
    "colour": ("Color of the {shape}?", "what color is that {shape}", "Which color does the {shape} have?",
               "Can you tell me what colour the {shape} is?"),
    "shape": ("What shape is the {colour} one?", "The {colour} object is which shape?"),
    "count": ("How many {plural} can you count?", "how many {plural} are there in this picture"),
    "total": ("How many objects can you see?",),
    "position": ("Where can I find the {colour} {shape}?",),
    "what_in": ("What is shown {where}?",),
    "word": ("Which word is printed here?",),
    "yesno": ("Is {a} {colour} {shape} visible?",),
}


def _fill(template: str, **facts) -> str:
    return template.format(**facts)


def casual_qa(scene: Scene, rng: random.Random, held_out: bool = False) -> list[QA]:
    """One question per fact of ``scene`` in a phrasing drawn from TRAIN (or HELD_OUT), canonical answers."""
    table = HELD_OUT if held_out else TRAIN
    objects = scene.objects
    counts = {s: sum(o.shape == s for o in objects) for s in SHAPES}
    present = {(o.colour, o.shape) for o in objects}
    qa: list[QA] = []
    for o in objects:
        if counts[o.shape] == 1:  # an ambiguous shape would need its region: the templates cover that
            qa.append(QA(_fill(rng.choice(table["colour"]), shape=o.shape), o.colour, "colour"))
        qa.append(QA(_fill(rng.choice(table["shape"]), colour=o.colour), o.shape, "shape"))
        qa.append(QA(_fill(rng.choice(table["position"]), colour=o.colour, shape=o.shape), o.region, "position"))
        qa.append(QA(_fill(rng.choice(table["what_in"]), where=REGION_PHRASES[o.region]), o.name, "position"))
        qa.append(QA(_fill(rng.choice(table["yesno"]), a=o.name.split()[0], colour=o.colour, shape=o.shape),
                     "yes", "yesno"))
    for s in SHAPES:
        if counts[s] or rng.random() < 0.15:
            qa.append(QA(_fill(rng.choice(table["count"]), plural=PLURALS[s]), str(counts[s]), "count"))
    qa.append(QA(rng.choice(table["total"]), str(len(objects)), "count"))
    if scene.word:
        qa.append(QA(rng.choice(table["word"]), scene.word, "word"))
    absent = [(o.colour, s) for o in objects for s in SHAPES if (o.colour, s) not in present]
    if absent:
        c, s = rng.choice(absent)
        a = "an" if c[0] in "aeiou" else "a"
        qa.append(QA(_fill(rng.choice(table["yesno"]), a=a, colour=c, shape=s), "no", "yesno"))
    return qa
