"""Full: the uncompressed cache. The reference every other method is compared with."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass(frozen=True)
class FullPolicy(Policy):
    """Full: the uncompressed key/value cache of a Transformer decoder, the reference for every other method.
    Paper: "Attention Is All You Need" (Vaswani et al., 2017), https://arxiv.org/abs/1706.03762"""

    name = "full"
    control = None
    label = "Full"
    summary = "No compression; must match plain generation token for token."
    colour = "#222222"  # black: the reference stands out in every figure
    uses_budget = False
    schedule = "none"
    stage = "none"
    roles = ("reference",)
