"""Full: the uncompressed cache. The reference every other method is compared with."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass(frozen=True)
class FullPolicy(Policy):
    name = "full"
    label = "Full"
    summary = "No compression; must match plain generation token for token."
    colour = "#222222"  # black: the reference stands out in every figure
    uses_budget = False
    schedule = "none"
    stage = "none"
