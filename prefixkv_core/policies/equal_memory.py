"""Equal-memory mode: prompt-only methods (SnapKV, PyramidKV, LOOK-M, PrefixKV with decode = grow) held at
about r·N_t entries after the prompt and after every token, the way the every-step methods hold themselves, so
all budgeted methods are compared at the same memory and under the same rules.

1. Layer l holds round(ρ_l · N_t) entries, where ρ_l is the layer's share right after the method compressed the
   prompt, rescaled so the shares average r (PyramidKV keeps its per-layer capacities; LOOK-M, whose text may
   exceed the budget with `text_prior = keep_all`, is brought down to r).
2. Always kept: the attention sink, the last prompt token and the newest entry.
3. Then every user turn fed after the prompt (a follow-up question, or the question of a query-agnostic run)
   whole, for the rest of the conversation (cut, oldest tokens first, only in a layer whose whole budget is
   smaller than the question).
4. Then the recent window the every-step methods protect: the newest max(1, round(RECENT_SHARE · T_l)) entries
   of the layer (H2O's published split: half of its budget for recent tokens), generated or prompt.
5. Generated entries that have left the window go first, the oldest first.
6. Then the prompt's entries go in the order of the method's OWN ranking (`HoldRank`), lowest first: SnapKV and
   PyramidKV their observation window, then the rest by max-pooled window votes, per KV head; LOOK-M its recent
   window, then text, then image tokens, each by accumulated attention, per KV head (and it merges what it
   evicts into the most similar kept key); AdaKV its window votes ranked across all KV heads of the layer (a
   head keeps as many as it has among the layer's best); PrefixKV its scorer. A method that states none: its
   entries' accumulated attention (the prefill's column sums, per KV head).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.cache import TrackedCache, TrackedLayer
from . import scoring
from .base import EMPTY_SLOT, DecodeView, LayerPlan, budget_count, tiered_keep

MIN_HELD = 3  # the sink, the last prompt token and the newest entry
RECENT_SHARE = 0.5  # the recent window every-step methods protect: H2O's published half of the budget
_PROTECTED, _TURN, _WINDOW, _PROMPT, _GENERATED = 0, 1, 2, 3, 1_000_000  # ranking tiers, lowest kept first
_EMPTY = 2_000_000  # an empty slot of a head-wise layer (AdaKV): never kept


@dataclass
class HoldRank:
    """A held method's own ranking of its prompt entries, indexed by prompt position: a lower tier is kept
    longer, then a higher score. Shapes [B, 1|Hkv, N] (one ranking per layer, or per KV head)."""

    scores: torch.Tensor  # fp32
    tiers: torch.Tensor  # integer, >= 0

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


def snap_rank(window_votes: torch.Tensor, window: int, kernel: int) -> HoldRank:
    """SnapKV's (and PyramidKV's) own order: the observation window first, then max-pooled window votes, per KV
    head. window_votes [B, Hkv, N]."""
    n = window_votes.shape[-1]
    pos = torch.arange(n, device=window_votes.device).view(1, 1, -1)
    return ranked(scoring.snap_window(window_votes, window, kernel), pos >= n - min(window, n))


def accumulated_rank(layer: TrackedLayer, prompt_len: int) -> HoldRank:
    """The fallback ranking: each prompt entry's accumulated attention (per KV head), by position."""
    b, h, _ = layer.positions.shape
    scores = torch.zeros(b, h, prompt_len + 1, device=layer.positions.device)  # the last slot takes generated ones
    scores.scatter_(-1, layer.positions.clamp(max=prompt_len), layer.scores.float())
    return ranked(scores[..., :prompt_len])


def layer_shares(cache: TrackedCache, prompt_len: int, budget: float) -> list[float]:
    """Each layer's share of N_t to hold: its prompt entries now over N, rescaled to average `budget`."""
    kept = [int((layer.positions[0, 0] < prompt_len).sum()) for layer in cache.layers]
    mean = sum(kept) / len(kept)
    if mean <= 0:
        return [budget] * len(kept)
    return [budget * k / mean for k in kept]


def _held_order(positions: torch.Tensor, prompt_len: int, target: int, rank: HoldRank,
                turns: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(score, tier, always kept) of every entry of a held layer [B, Hkv, T] by the rule in the module docstring:
    lower tier kept first, then higher score. `target`: the entries one head may hold."""
    newest_first = torch.argsort(torch.argsort(positions, dim=-1, descending=True), dim=-1)  # 0 = the newest
    window = newest_first < max(1, int(round(RECENT_SHARE * target)))
    protected = (positions == 0) | (positions == prompt_len - 1) | (newest_first == 0)
    turn = torch.zeros_like(protected)
    for start, end in turns:
        turn |= (positions >= start) & (positions < end)
    prompt = positions < prompt_len
    own_scores, own_tiers = rank.at(positions, prompt_len)
    tier = torch.where(protected, _PROTECTED, torch.where(turn, _TURN, torch.where(window, _WINDOW, torch.where(
        prompt, _PROMPT + own_tiers, _GENERATED))))
    # the method's scores order its prompt entries; recency orders the turns, the window and generated entries
    score = torch.where(prompt & ~window, own_scores, positions.float())
    return score, tier, protected


def held_keep(positions: torch.Tensor, prompt_len: int, target: int, rank: HoldRank,
              turns: list[tuple[int, int]]) -> torch.Tensor:
    """Indices [B, Hkv, K] (ascending) of the entries a held layer keeps, by the rule in the module docstring.
    positions [B, Hkv, T]: the entries' true positions; turns: [start, end) position spans of fed user turns.
    K = target, or more when the entries that are always kept outnumber it."""
    score, tier, protected = _held_order(positions, prompt_len, target, rank, turns)
    k = max(target, int(protected.sum(dim=-1).max()))
    return tiered_keep(score, k, tier)


def held_keep_across_heads(positions: torch.Tensor, prompt_len: int, target: int, rank: HoldRank,
                           turns: list[tuple[int, int]]) -> tuple[torch.Tensor, bool]:
    """The same rule for a layer whose KV heads hold different counts (AdaKV): the layer keeps Hkv · target
    entries in all, every head's entries ranked together, so a head keeps as many as it has among the best.
    positions [1, Hkv, T] with EMPTY_SLOT padding (never kept). Returns (keep [1, Hkv, K] ascending, EMPTY_SLOT
    first in the heads that keep fewer; whether any head does)."""
    _, h, t = positions.shape
    real = positions >= 0
    score, tier, protected = _held_order(positions, prompt_len, target, rank, turns)
    tier = torch.where(real, tier, _EMPTY)
    k = min(int(real.sum()), max(h * target, int((protected & real).sum())))
    chosen = tiered_keep(score.reshape(1, 1, -1), k, tier.reshape(1, 1, -1))[0, 0]
    per_head = [chosen[chosen // t == g] % t for g in range(h)]  # ascending within each head
    longest = max(c.numel() for c in per_head)
    rows = [torch.cat([c.new_full((longest - c.numel(),), EMPTY_SLOT), c]) for c in per_head]
    return torch.stack(rows).unsqueeze(0), min(c.numel() for c in per_head) < longest


def hold_plans(view: DecodeView, shares: list[float], ranks: list[HoldRank],
               turns: list[tuple[int, int]]) -> list[LayerPlan | None]:
    """Plans that bring layer l to round(shares[l] · N_t) entries (at least MIN_HELD) by the rule above."""
    plans: list[LayerPlan | None] = []
    for layer, share, rank in zip(view.cache.layers, shares, ranks):
        target = budget_count(share, view.full_len, min_keep=MIN_HELD)  # r is a share of the uncompressed N_t
        if layer.length <= target:
            plans.append(None)
            continue
        plans.append(LayerPlan(keep=held_keep(layer.positions, view.prompt_len, target, rank, turns)))
    return plans
