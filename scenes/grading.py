"""How an answer to a scene question is graded: its normalised text (lowercase, punctuation dropped) equals
the reference or starts with it as whole words. The vision benchmark and the training's checks grade alike."""
from __future__ import annotations

import re


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9\- ]+", " ", text.lower()).split())


def is_correct(output: str, answer: str) -> bool:
    out, ref = normalise(output), normalise(answer)
    return bool(ref) and (out == ref or out.startswith(ref + " "))
