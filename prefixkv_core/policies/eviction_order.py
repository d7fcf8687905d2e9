"""The order in which a method would evict its prompt's entries, when something must make room for newer ones
later (the equal-memory hold, `equal_memory.py`): each method states its own (`Policy.eviction_order`), else the
entries' accumulated attention is used."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..kv.cache import TrackedLayer
from . import scoring
from .base import Merge


@dataclass
class HoldRank:
    """A held method's own ranking of its prompt entries, indexed by prompt position: a lower tier is kept
    longer, then a higher score. Shapes [B, 1|Hkv, N] (one ranking per layer, or per KV head)."""

    scores: torch.Tensor  # fp32
    tiers: torch.Tensor  # integer, >= 0
    # True: the layer's KV heads are ranked together, so a head keeps as many as it has among the layer's best
    # (AdaKV's head-wise budgets); False: every head keeps the same count
    across_heads: bool = False
    # what the method does with what it evicts: (keys [B, Hkv, T, D], keep) -> a Merge (LOOK-M); None: drops it
    merge: Callable[[torch.Tensor, torch.Tensor], Merge] | None = None

    def at(self, positions: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, tiers) of the entries at `positions` [B, Hkv, T] (generated positions read the last prompt
        token's; callers mask them)."""
        b, h, _ = positions.shape
        idx = positions.clamp(min=0, max=prompt_len - 1)
        return (self.scores.expand(b, h, -1).gather(-1, idx), self.tiers.expand(b, h, -1).gather(-1, idx))


def ranked(scores: torch.Tensor, first: torch.Tensor | None = None) -> HoldRank:
    """A ranking by `scores` [B, 1|Hkv, N]; entries where `first` (broadcastable bool) go last of all prompt
    entries (e.g. SnapKV's observation window, which its own selection keeps whatever it scores)."""
    tiers = torch.ones_like(scores, dtype=torch.long)
    if first is not None:
        tiers = torch.where(first.expand_as(tiers), 0, tiers)
    return HoldRank(scores.float(), tiers)


def snap_rank(window_votes: torch.Tensor, window: int, kernel: int, across_heads: bool = False) -> HoldRank:
    """SnapKV's (and PyramidKV's, AdaKV's) own order: the observation window first, then max-pooled window votes,
    pooled without the sink's vote (ties in the hold go by position),
    per KV head. window_votes [B, Hkv, N]."""
    n = window_votes.shape[-1]
    pos = torch.arange(n, device=window_votes.device).view(1, 1, -1)
    rank = ranked(scoring.snap_window(window_votes, window, kernel, sink=1), pos >= n - min(window, n))
    rank.across_heads = across_heads
    return rank


def accumulated_rank(layer: TrackedLayer, prompt_len: int) -> HoldRank:
    """The fallback ranking: each prompt entry's accumulated attention (per KV head), by position."""
    b, h, _ = layer.positions.shape
    scores = torch.zeros(b, h, prompt_len + 1, device=layer.positions.device)  # the last slot takes generated ones
    scores.scatter_(-1, layer.positions.clamp(max=prompt_len), layer.scores.float())
    return ranked(scores[..., :prompt_len])
