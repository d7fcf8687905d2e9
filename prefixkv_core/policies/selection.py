"""Which prompt entries a layer keeps, given its scores and how many it may keep: the pure tensor rules every
scoring method shares (`scored.ScoredPolicy` calls them; tests compare them with naive references).

- `window_select`: the last W prompt tokens always kept, the best of the rest per KV head (SnapKV's selection).
- `flattened_counts`: how many entries each KV head gets when all heads of a layer compete in one ranking (AdaKV).
- `floored_counts`: those counts with a floor every head keeps (AdaKV's safeguard).
- `heads_select`: per KV head its own count of best entries, the shorter heads padded with empty slots.
"""
from __future__ import annotations

import torch

from ..report.lorenz import distribute
from . import scoring
from .base import EMPTY_SLOT


def best_first(scores: torch.Tensor, k: int, raw: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the k highest scores along the last axis; ties go to the higher `raw` score (when given), then
    to the lower index."""
    if raw is None:
        return torch.argsort(scores.float(), dim=-1, descending=True, stable=True)[..., :k]
    return scoring.two_key_order(scores, raw)[..., :k]


def window_select(prefix: torch.Tensor, tiebreak: torch.Tensor | None, capacity: int, window: int) -> torch.Tensor:
    """prefix [B, H, N - W]: the scores of the tokens before the last `window` (protected ones at +inf) ->
    kept indices [B, H, capacity] (ascending): the best `capacity - window` of them (ties by `tiebreak`, then by
    position), then the window."""
    b, h, before = prefix.shape
    n = before + window
    k = max(0, min(capacity - window, before))
    chosen = best_first(prefix, k, tiebreak)
    tail = torch.arange(before, n, device=prefix.device).view(1, 1, -1).expand(b, h, -1)
    return torch.cat([chosen.sort(dim=-1).values, tail], dim=-1)


def flattened_counts(scores: torch.Tensor, total: int, raw: torch.Tensor | None = None) -> torch.Tensor:
    """scores [B, H, M] -> [B, H] how many of each head's entries are among the `total` best of all heads' entries
    ranked together (the adaptive, head-wise allocation); ties by `raw` [B, H, M] when given, then the lower
    (head, index)."""
    b, h, m = scores.shape
    total = max(0, min(total, h * m))
    best = best_first(scores.reshape(b, h * m), total, None if raw is None else raw.reshape(b, h * m))
    counts = torch.zeros(b, h, dtype=torch.long, device=scores.device)
    return counts.scatter_add_(1, best // m, torch.ones_like(best))


def floored_counts(adaptive: list[int], total: int, floor_alpha: float, high: int, low: int = 1) -> list[int]:
    """AdaKV's safeguard: head h gets round(c_h·(1 - α) + ⌊α·b⌋) with b = total / heads, here spread so the
    counts sum to exactly `total` (largest remainders), each in [low, high]."""
    heads = len(adaptive)
    floor = int(floor_alpha * total / heads)
    weights = [c * (1.0 - floor_alpha) + floor for c in adaptive]
    return distribute(total, weights, low=min(low, high), high=high)


def heads_select(prefix: torch.Tensor, tiebreak: torch.Tensor | None, counts: list[int], window: int
                 ) -> torch.Tensor:
    """One row: prefix [1, H, N - W] scores before the window, counts[h] entries head h keeps from them ->
    [1, H, max(counts) + W] indices: per head its best entries (ascending), then the window; EMPTY_SLOT first in
    the heads that keep fewer."""
    before = prefix.shape[-1]
    tail = torch.arange(before, before + window, device=prefix.device)
    chosen = [best_first(prefix[0, h], c, None if tiebreak is None else tiebreak[0, h]) for h, c in enumerate(counts)]
    return padded_keep(chosen, tail)


def padded_keep(chosen: list[torch.Tensor], tail: torch.Tensor) -> torch.Tensor:
    """Per head, kept indices (ascending, any count) then the `tail` indices every head keeps -> [1, H, K_max + T]
    with EMPTY_SLOT first in the heads that keep fewer."""
    longest = max(c.numel() for c in chosen)
    rows = [torch.cat([c.new_full((longest - c.numel(),), EMPTY_SLOT), c.sort().values, tail]) for c in chosen]
    return torch.stack(rows).unsqueeze(0)
