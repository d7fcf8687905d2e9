"""What a rendered scene is: its objects, its question/answer pairs and the image with its description."""
from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from .vocabulary import article


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
        return f"{article(self.colour)} {self.colour} {self.shape}"

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
