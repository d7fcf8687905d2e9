"""Lorenz curves and Gini coefficients of per-layer importance, and PrefixKV's global bisection.

For one layer, sort token importances in decreasing order and normalise them to sum to one: the
cumulative sum P(o) at o = k/N is the share of all importance held by the k most important tokens.
(That is the "information retention" curve of the PrefixKV paper, a Lorenz curve read from the top.)
The Gini coefficient is 2·(area under that curve) - 1 = 1 - 2·(area under the usual ascending curve).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def normalise(importance: torch.Tensor) -> torch.Tensor:
    """[L, N] non-negative -> rows summing to one (a row of zeros becomes uniform)."""
    imp = importance.float().clamp_min(0)
    total = imp.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(imp, 1.0 / imp.shape[-1])
    return torch.where(total > 0, imp / total.clamp_min(1e-30), uniform)


def retention_curves(importance: torch.Tensor) -> torch.Tensor:
    """[L, N] -> [L, N+1]: P_l(k/N) for k = 0..N, starting at 0 and ending at 1, non-decreasing, concave."""
    p = normalise(importance)
    sorted_desc, _ = torch.sort(p, dim=-1, descending=True)
    cum = torch.cumsum(sorted_desc.double(), dim=-1)
    cum = cum / cum[:, -1:].clamp_min(1e-30)
    zeros = torch.zeros(cum.shape[0], 1, dtype=cum.dtype, device=cum.device)
    return torch.cat([zeros, cum], dim=-1).clamp_(0.0, 1.0).float()


def lorenz_curves(importance: torch.Tensor) -> torch.Tensor:
    """[L, N] -> [L, N+1]: the classic ascending Lorenz curve (share held by the k least important)."""
    ret = retention_curves(importance)
    return (1.0 - ret.flip(-1)).clamp_(0.0, 1.0)


def gini(importance: torch.Tensor) -> torch.Tensor:
    """[L, N] -> [L] in [0, 1]: 0 for uniform importance, -> 1 when one token holds everything."""
    lor = lorenz_curves(importance).double()
    n = lor.shape[-1] - 1
    area = torch.trapezoid(lor, dx=1.0 / n, dim=-1)
    return (1.0 - 2.0 * area).clamp(0.0, 1.0).float()


def counts_for_threshold(curves: torch.Tensor, p: float) -> torch.Tensor:
    """[L, N+1] retention curves -> [L] smallest k with P_l(k/N) >= p."""
    n = curves.shape[-1] - 1
    reached = curves >= (p - 1e-7)
    # first True along the row; every row ends at 1 so there is always one
    return reached.float().argmax(dim=-1).clamp(0, n)


@dataclass
class BisectionResult:
    threshold: float  # the global information-retention threshold p
    counts: list[int]  # kept tokens per layer (protected tokens included), summing to round(r·N·L)
    ratios: list[float]  # counts / N
    iterations: int
    converged: bool  # the search itself got within one token per layer of the target


def bisect_threshold(curves: torch.Tensor, budget: float, min_keep: int = 1, max_iter: int = 60,
                     total: int | None = None) -> BisectionResult:
    """Find p in [0, 1] with Σ_l R_l(p)·N ≈ r·N·L, then make the counts sum exactly to round(r·N·L).

    `total` replaces round(r·N·L) as the number of entries to share out (e.g. when the curves leave out tokens
    that are kept anyway)."""
    n_layers, n = curves.shape[0], curves.shape[-1] - 1
    target_total = int(round(budget * n * n_layers)) if total is None else int(total)
    lo, hi = 0.0, 1.0
    best = counts_for_threshold(curves, hi)
    converged = False
    iterations = 0
    p = hi
    for iterations in range(1, max_iter + 1):
        p = 0.5 * (lo + hi)
        counts = counts_for_threshold(curves, p)
        total = int(counts.sum())
        best = counts
        if abs(total - target_total) <= n_layers:
            converged = True
            break
        if total < target_total:
            lo = p
        else:
            hi = p
    exact = fit_counts_to_total(best.double(), target_total, low=min_keep, high=n, curves=curves)
    return BisectionResult(
        threshold=float(p),
        counts=[int(c) for c in exact],
        ratios=[float(c) / n for c in exact],
        iterations=iterations,
        converged=converged,
    )


def fit_counts_to_total(counts: torch.Tensor, total: int, low: int, high: int, curves=None) -> list[int]:
    """Adjust per-layer counts (clamped to [low, high]) so they sum to `total`.

    With curves, add tokens where the next token retains the most information and remove where the last
    one retains the least; otherwise spread the difference evenly (largest remainders first).
    """
    c = counts.round().clamp(low, high).long().tolist()
    n_layers = len(c)
    total = max(low * n_layers, min(high * n_layers, total))
    diff = total - sum(c)
    while diff != 0:
        step = 1 if diff > 0 else -1
        candidates = [i for i in range(n_layers) if low <= c[i] + step <= high]
        if curves is not None:
            def gain(i):
                k = c[i]
                return float(curves[i, k + 1] - curves[i, k]) if step > 0 else -float(curves[i, k] - curves[i, k - 1])
            i = max(candidates, key=gain)
        else:
            i = min(candidates, key=lambda j: c[j]) if step > 0 else max(candidates, key=lambda j: c[j])
        c[i] += step
        diff -= step
    return c


def distribute(total: int, weights: list[float], low: int, high: int) -> list[int]:
    """Integers proportional to `weights`, each in [low, high], summing to `total` (largest remainders)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum() if w.sum() > 0 else np.full_like(w, 1.0 / len(w))
    raw = w * total
    base = np.clip(np.floor(raw), low, high).astype(int)
    remainder = raw - np.floor(raw)
    order = list(np.argsort(-remainder, kind="stable"))
    diff = total - int(base.sum())
    guard = 0
    while diff != 0 and guard < 10 * len(w) + abs(diff) * len(w):
        for i in order:
            if diff == 0:
                break
            if diff > 0 and base[i] < high:
                base[i] += 1
                diff -= 1
            elif diff < 0 and base[i] > low:
                base[i] -= 1
                diff += 1
        guard += 1
    return [int(x) for x in base]
