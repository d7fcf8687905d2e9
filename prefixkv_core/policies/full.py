"""Full: the uncompressed cache. The reference every other method is compared with."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass
class FullPolicy(Policy):
    name = "full"
    label = "Full"
    summary = "No compression; must match plain generation token for token."
    uses_budget = False
    schedule = "none"

    def __post_init__(self):
        # Full ignores the budget; it is accepted so every method can be built the same way.
        pass
