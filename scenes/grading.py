"""How an answer to a scene question is graded: its normalised text (lowercase, punctuation dropped) equals
the reference or starts with it as whole words. The vision benchmark and the training's checks grade alike.
``is_correct_image_number`` grades an image number (the multi-image ``which`` questions): "Image 2" counts as "2"."""
from __future__ import annotations

import re


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9\- ]+", " ", text.lower()).split())


def is_correct(output: str, answer: str) -> bool:
    out, ref = normalise(output), normalise(answer)
    return bool(ref) and (out == ref or out.startswith(ref + " "))


_IMAGE_LEAD = re.compile(r"^(?:the )?(?:image|picture|img)(?: number| no)? ")


def is_correct_image_number(output: str, answer: str) -> bool:
    """An image number ("2"): graded as ``is_correct``, also after a leading "image" ("Image 2.", "the image 2")."""
    return is_correct(output, answer) or is_correct(_IMAGE_LEAD.sub("", normalise(output)), answer)
