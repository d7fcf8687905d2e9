"""The learning-rate schedule every stage follows: linear warm-up, then a cosine down to a tenth."""
from __future__ import annotations

import math


def lr_at(step: int, steps: int, warmup: int) -> float:
    """The factor on each parameter group's base learning rate at `step` of `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
