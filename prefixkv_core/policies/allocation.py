"""How many entries each layer keeps: per-layer counts for a budget r (the mean share kept over layers).

- `uniform`: the same count in every layer (Local, H2O, SnapKV, Elastic Cache).
- `pyramid`: counts that shrink linearly with depth (PyramidKV's published schedule).
- `lorenz_bisection`: one information-retention threshold p for every layer, found by bisection on the
  layers' retention (Lorenz) curves, so layers whose importance is concentrated keep fewer entries (PrefixKV).
- `from_ratios`: counts proportional to given per-layer ratios (offline PrefixKV's calibrated ratios).

Counts are per layer; a layer keeps the same number of entries in every KV head (the cache is one tensor per
layer), so head-wise methods differ per head in *which* entries they keep (see scoring.py), not how many.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..report.lorenz import BisectionResult, bisect_threshold, distribute, retention_curves
from .base import budget_count


def uniform(budget: float, length: int, num_layers: int, min_keep: int = 1) -> list[int]:
    """round(r·length) entries in every layer, at least `min_keep` (and at most `length`)."""
    return [budget_count(budget, length, min_keep)] * num_layers


def pyramid(n: int, num_layers: int, budget: float, window: int, beta: int = 20) -> list[int] | None:
    """Per-layer capacities (window included), decreasing with depth, averaging r·N; None = the published
    fallback to uniform capacities.

    The published schedule: with M = r·N, min = (M-W)//β, max = 2(M-W) - min, clipped at N-W (min then
    2(M-W) - max); the method falls back to uniform SnapKV when N < 2(M-W). Integer rounding is spread so the
    mean is exact."""
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


def lorenz_bisection(importance: torch.Tensor, budget: float, min_keep: int = 1, skip_first: int = 0
                     ) -> BisectionResult:
    """importance [L, N] (>= 0) -> per-layer counts (summing to round(r·N·L)) from one retention threshold.

    `skip_first` leaves the first tokens (the attention sink) out of the curves: they are kept in every layer
    anyway, so the threshold shares out only the other round(r·N·L) - skip_first·L entries, over curves of the
    remaining N - skip_first tokens. Counts include the skipped tokens and are at least `min_keep`."""
    n_layers, n = importance.shape
    if skip_first <= 0:
        return bisect_threshold(retention_curves(importance), budget, min_keep=min(min_keep, n))
    s = min(skip_first, n - 1)
    curves = retention_curves(importance[:, s:])
    total = max(0, int(round(budget * n * n_layers)) - s * n_layers)
    found = bisect_threshold(curves, budget, min_keep=max(0, min(min_keep, n) - s), total=total)
    counts = [c + s for c in found.counts]
    return replace(found, counts=counts, ratios=[c / n for c in counts])


def from_ratios(ratios, total: int, low: int, high: int) -> list[int]:
    """Integer counts proportional to per-layer `ratios`, each in [low, high], summing to `total`."""
    return distribute(total, list(ratios), low=low, high=high)
