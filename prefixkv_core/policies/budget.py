"""The KV budget r: the kept fraction of the cache, in (0, 1].

A `Budget` is checked once, where a budget enters: the app's inputs, `Engine.new_session` and `make_policy` for a
script, the command-line flags of the CLI and the benchmarks (`method_args.py`). After that its range is a fact of
its type: a policy, the allocation pieces and the record take it as it is. It is a float, so arithmetic, JSON and
formatting treat it as the number it is."""
from __future__ import annotations

import math
from typing import Any

from .knobs import PolicyError


class Budget(float):
    """A kept fraction in (0, 1]. `Budget(x)` raises PolicyError with what is accepted; a Budget passes as is."""

    __slots__ = ()

    def __new__(cls, value: Any) -> "Budget":
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
            raise PolicyError(f"budget must be a number in (0, 1], got {shown}")
        if not 0.0 < value <= 1.0:
            shown = f"{float(value):g}"
            if 0.0 < float(shown) <= 1.0:  # rounding would show an accepted value (1.0000001 as 1): show it all
                shown = repr(float(value))
            raise PolicyError(f"budget must be a kept fraction in (0, 1], got {shown}")
        return super().__new__(cls, float(value))


def check_budget(budget: Any) -> Budget:
    """The budget as a `Budget` (PolicyError when it is not a kept fraction in (0, 1])."""
    return Budget(budget)

