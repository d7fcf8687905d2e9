"""PyramidKV: SnapKV selection with per-layer capacities that shrink linearly with depth.

It is SnapKV with `layer_budget = pyramid` (uniform when the budget is too large for a pyramid, as published)
and the reference repository's shorter window."""
from __future__ import annotations

from dataclasses import dataclass

from . import allocation
from .base import knob
from .scored import LAYER_BUDGETS, WINDOW_HELP
from .snapkv import SnapKVPolicy


def pyramid_capacities(n: int, num_layers: int, budget: float, window: int, beta: int = 20) -> list[int] | None:
    """Per-layer capacities (window included) of PyramidKV's published schedule; see allocation.pyramid."""
    return allocation.pyramid(n, num_layers, budget, window, beta)


@dataclass(frozen=True)
class PyramidKVPolicy(SnapKVPolicy):
    """PyramidKV: SnapKV's selection with per-layer capacities that shrink linearly with depth.
    Paper: "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
    (Cai et al., 2024), https://arxiv.org/abs/2406.02069"""

    name = "pyramidkv"
    label = "PyramidKV"
    summary = ("SnapKV with a pyramid of budgets: lower layers keep more, upper layers less. Prompt only. "
               "Falls back to uniform SnapKV when the budget is large (as published).")
    colour = "#0072B2"

    # the reference repository's LongBench runs use a window of 8 (SnapKV's kernel 7 is kept)
    window: int = knob(8, help=WINDOW_HELP, low=1, high=4096, integer=True)
    layer_budget: str = knob("pyramid", choices=LAYER_BUDGETS, label="layer budget",
                             help="entries per layer: pyramid = shrinking linearly with depth (the method); "
                                  "uniform = the same count in every layer (SnapKV)")

    def eviction_order_words(self) -> str:
        return "its window votes, the observation window last, in its per-layer capacities"
