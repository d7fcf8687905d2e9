"""PyramidKV: SnapKV selection with per-layer capacities that shrink linearly with depth."""
from __future__ import annotations

from dataclasses import dataclass

from ..attention import StatRequest
from ..lorenz import distribute
from .base import LayerPlan, Policy, PrefillView
from .snapkv import snap_select


def pyramid_capacities(n: int, num_layers: int, budget: float, window: int, beta: int = 20) -> list[int] | None:
    """Per-layer capacities (window included), decreasing with depth, averaging r·N; None = uniform fallback.

    Follows the published schedule: min = (M-W)//β, max = 2(M-W) - min, clipped at N-W; the published
    method falls back to uniform SnapKV when N < 2(M-W). Integer rounding is spread so the mean is exact.
    """
    m = budget * n
    avg = m - window
    if n < 2 * avg or avg <= 0:
        return None
    lo = avg // beta
    hi = 2 * avg - lo
    if hi >= n - window:
        hi = n - window
        lo = 2 * avg - hi
    if num_layers == 1:
        continuous = [avg]
    else:
        continuous = [hi - l * (hi - lo) / (num_layers - 1) for l in range(num_layers)]
    total = int(round(avg * num_layers))
    counts = distribute(total, continuous, low=1, high=n - window)
    counts.sort(reverse=True)  # rounding must not break the pyramid
    return [c + window for c in counts]


@dataclass
class PyramidKVPolicy(Policy):
    name = "pyramidkv"
    label = "PyramidKV"
    summary = ("SnapKV with a pyramid of budgets: lower layers keep more, upper layers less. Prompt only. "
               "Falls back to uniform SnapKV when the budget is large (as published).")
    schedule = "prompt only"

    window: int = 8
    kernel: int = 7
    beta: int = 20

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(window=self.window)

    def prefill(self, view: PrefillView):
        n, n_layers = view.prompt_len, view.num_layers
        caps = pyramid_capacities(n, n_layers, self.budget, self.window, self.beta)
        self.notes = []
        if caps is None:
            self.notes.append(
                "budget too large for a pyramid (N < 2(M-W)): uniform SnapKV capacities, as published"
            )
            caps = [max(self.window + 1, int(round(self.budget * n)))] * n_layers
        self.capacities = caps
        return [
            LayerPlan(keep=snap_select(view.stats[i]["window"], caps[i], self.window, self.kernel))
            for i in range(n_layers)
        ]

    def extras(self):
        out = super().extras()
        if getattr(self, "capacities", None):
            out["capacities"] = list(self.capacities)
        return out
