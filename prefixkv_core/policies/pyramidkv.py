"""PyramidKV: SnapKV selection with per-layer capacities that shrink linearly with depth.

It is SnapKV's ranking (the window's votes, the window and the sink always kept) with the pyramid's per-layer
capacities (uniform when the budget is too large for a pyramid, as published) and the reference repository's
shorter window."""
from __future__ import annotations

from dataclasses import dataclass, field

from . import allocation
from .base import Fact, knob
from .snapkv import WINDOW_HELP, SnapKVPolicy, SnapState


def pyramid_capacities(n: int, num_layers: int, budget: float, window: int, beta: int = 20) -> list[int] | None:
    """Per-layer capacities (window included) of PyramidKV's published schedule; see allocation.pyramid."""
    return allocation.pyramid(n, num_layers, budget, window, beta)


@dataclass
class PyramidState(SnapState):
    capacities: list[int] = field(default_factory=list)  # entries kept per layer, window included
    uniform: bool = False  # the budget was too large for a pyramid (published fallback)


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
    beta: int = knob(20, help="pyramid steepness (top layer keeps 1/β of the bottom's share)", low=1, high=1000,
                     integer=True, label="β (beta)")

    def new_state(self, window: int) -> PyramidState:
        return PyramidState(window=window)

    def layer_capacities(self, prompt_len: int, num_layers: int, window: int, state: PyramidState) -> list[int]:
        caps = pyramid_capacities(prompt_len, num_layers, self.budget, window, self.beta)
        if caps is None:
            state.uniform = True
            state.notes.append("budget too large for a pyramid (N < 2(M-W)): uniform SnapKV capacities, as published")
            caps = super().layer_capacities(prompt_len, num_layers, window, state)
        state.capacities = caps
        return caps

    def eviction_order_words(self) -> str:
        return "its window votes, the observation window last, in its per-layer capacities"

    def facts(self, state: PyramidState) -> list[Fact]:
        caps = [Fact("capacities", "capacity per KV head (every head the same count, window included)",
                     list(state.capacities), kind="per-layer", fmt="d", unit=" entries")]
        # the capacities are the per-head counts: SnapKV's own per-head fact would repeat them
        rest = [f for f in super().facts(state) if f.key != "per_head"]
        return (caps if state.capacities else []) + rest
