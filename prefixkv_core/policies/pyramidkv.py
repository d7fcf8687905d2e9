"""PyramidKV: SnapKV selection with per-layer capacities that shrink linearly with depth.

Preset: pyramid allocation (uniform when the budget is too large, as published), SnapKV's window scorer."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..attention import StatRequest
from . import allocation
from .base import Fact, LayerPlan, Policy, Prefilled, PrefillView, knob
from .equal_memory import snap_rank
from .snapkv import KERNEL_HELP, WINDOW_HELP, SnapState, check_kernel, clamp_window, snap_select


def pyramid_capacities(n: int, num_layers: int, budget: float, window: int, beta: int = 20) -> list[int] | None:
    """Per-layer capacities (window included) of PyramidKV's published schedule; see allocation.pyramid."""
    return allocation.pyramid(n, num_layers, budget, window, beta)


@dataclass
class PyramidState(SnapState):
    capacities: list[int] = field(default_factory=list)  # entries kept per layer, window included
    uniform: bool = False  # the budget was too large for a pyramid (published fallback)


@dataclass(frozen=True)
class PyramidKVPolicy(Policy):
    """PyramidKV: SnapKV's selection with per-layer capacities that shrink linearly with depth.
    Paper: "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
    (Cai et al., 2024), https://arxiv.org/abs/2406.02069"""

    name = "pyramidkv"
    label = "PyramidKV"
    summary = ("SnapKV with a pyramid of budgets: lower layers keep more, upper layers less. Prompt only. "
               "Falls back to uniform SnapKV when the budget is large (as published).")
    colour = "#0072B2"
    schedule = "prompt only"
    stage = "KV eviction"

    # the reference repository's LongBench runs: window 8, max pooling with kernel 7
    window: int = knob(8, help=WINDOW_HELP, low=1, high=4096, integer=True)
    kernel: int = knob(7, help=KERNEL_HELP, low=1, high=63, integer=True)
    beta: int = knob(20, help="pyramid steepness (top layer keeps 1/β of the bottom's share)", low=1, high=1000,
                     integer=True, label="β (beta)")

    def check(self) -> None:
        check_kernel(self.label, self.kernel)

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(window=clamp_window(self.window, prompt_len, self.budget)[0])

    def prefill(self, view: PrefillView) -> Prefilled:
        n, n_layers = view.prompt_len, view.num_layers
        w, clamped = clamp_window(self.window, n, self.budget)
        state = PyramidState(notes=[clamped] if clamped else [], window=w)
        caps = pyramid_capacities(n, n_layers, self.budget, w, self.beta)
        if caps is None:
            state.uniform = True
            state.notes.append("budget too large for a pyramid (N < 2(M-W)): uniform SnapKV capacities, as published")
            caps = allocation.uniform(self.budget, n, n_layers, min_keep=w + 1)
        state.capacities = caps
        plans = [LayerPlan(keep=snap_select(view.stats[i]["window"], caps[i], w, self.kernel))
                 for i in range(n_layers)]
        if self.held_to_equal_memory():  # its own order; the held shares keep its per-layer capacities
            state.hold_ranks = [snap_rank(view.stats[i]["window"], w, self.kernel) for i in range(n_layers)]
        return Prefilled(plans, state)

    def hold_ranking(self) -> str:
        return "its window votes, the observation window last, in its per-layer capacities"

    def facts(self, state: PyramidState) -> list[Fact]:
        caps = [Fact("capacities", "capacity", list(state.capacities), kind="per-layer", fmt="d", unit=" entries")]
        return (caps if state.capacities else []) + super().facts(state)
