"""AdaKV (Ada-SnapKV): SnapKV's observation-window votes, with each layer's budget shared out among its KV heads.

Paper: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference", 2024, https://arxiv.org/abs/2407.11550.

A layer keeps the same total as SnapKV (`Hkv · C` entries), but instead of `C` per KV head, the votes of all
its heads compete in one ranking: a head whose attention is concentrated needs few entries, a head whose
attention is spread gets more. A floor (share `floor_alpha` of the per-head budget) keeps every head from
starving, as the reference configuration does. The cache then holds a different number of entries per head:
the shorter heads are padded with empty slots, masked from attention and not counted in the reported bytes
(the entries actually kept, as the method's flattened per-head cache stores them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..report.lorenz import distribute
from . import scoring
from .base import EMPTY_SLOT, Fact, LayerPlan, PolicyState, Prefilled, PrefillView, budget_count, knob
from .eviction_order import snap_rank
from .snapkv import SnapKVPolicy, SnapState, clamp_window, snap_votes


def best_first(scores: torch.Tensor, k: int, raw: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the k highest scores along the last axis; ties go to the higher `raw` score (when given), then
    to the lower index."""
    if raw is None:
        return torch.argsort(scores.float(), dim=-1, descending=True, stable=True)[..., :k]
    return scoring.two_key_order(scores, raw)[..., :k]


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
    """The reference's safeguard: head h gets round(c_h·(1 - α) + ⌊α·b⌋) with b = total / heads, here spread so
    the counts sum to exactly `total` (largest remainders), each in [low, high]."""
    heads = len(adaptive)
    floor = int(floor_alpha * total / heads)
    weights = [c * (1.0 - floor_alpha) + floor for c in adaptive]
    return distribute(total, weights, low=min(low, high), high=high)


def padded_keep(chosen: list[torch.Tensor], tail: torch.Tensor) -> torch.Tensor:
    """Per head, kept indices (ascending, any count) then the `tail` indices every head keeps -> [1, H, K_max + T]
    with EMPTY_SLOT first in the heads that keep fewer."""
    longest = max(c.numel() for c in chosen)
    rows = [torch.cat([c.new_full((longest - c.numel(),), EMPTY_SLOT), c.sort().values, tail]) for c in chosen]
    return torch.stack(rows).unsqueeze(0)


@dataclass
class AdaKVState(SnapState):
    head_counts: list[list[int]] = field(default_factory=list)  # per layer, prompt entries kept per KV head


@dataclass(frozen=True)
class AdaKVPolicy(SnapKVPolicy):
    """AdaKV (Ada-SnapKV): head-wise budgets over SnapKV's observation-window votes, the layer's total fixed.
    Paper: "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference"
    (Feng et al., 2024), https://arxiv.org/abs/2407.11550"""

    name = "adakv"
    label = "AdaKV"
    summary = ("SnapKV's window votes ranked across all KV heads of a layer: each head keeps its own count, the "
               "layer's total is SnapKV's. Compresses the prompt once; the cache then grows while decoding.")
    colour = "#66A61E"
    schedule = "prompt only"
    stage = "KV eviction"

    # SnapKV's window and kernel knobs, check and statistics request, inherited
    floor_alpha: float = knob(0.2, help="share of the per-head budget every KV head keeps whatever the ranking "
                                        "(the reference's safeguard; 0 = purely adaptive)", low=0.0, high=1.0)

    def new_state(self, window: int) -> AdaKVState:
        return AdaKVState(window=window)

    def plans_rows_together(self) -> bool:
        return False  # each prompt's heads split the budget their own way: a cache per prompt

    def prefill(self, view: PrefillView) -> Prefilled:
        n = view.prompt_len
        w, clamped = clamp_window(self.window, n, self.budget)
        state = self.new_state(w)
        if clamped:
            state.notes.append(clamped)
        capacity = budget_count(self.budget, n, min_keep=w + 1)  # per KV head on average, window included
        plans: list[LayerPlan | None] = []
        for i in range(view.num_layers):
            # pooled votes (the sink's pooled out, the sink at +inf in every head, as SnapKV here) and raw votes
            prefix, raw = snap_votes(view.stats[i]["window"], w, self.kernel)
            heads = prefix.shape[1]
            if capacity >= n:
                state.head_counts.append([n - w] * heads)
                plans.append(None)
                continue
            per_head = capacity - w
            total = heads * per_head
            adaptive = flattened_counts(prefix, total, raw)[0].tolist()
            counts = floored_counts(adaptive, total, self.floor_alpha, high=n - w)
            chosen = [best_first(prefix[0, h], c, raw[0, h]) for h, c in enumerate(counts)]
            tail = torch.arange(n - w, n, device=prefix.device)
            state.head_counts.append(counts)
            plans.append(LayerPlan(keep=padded_keep(chosen, tail), empty_slots=min(counts) < max(counts)))
        return Prefilled(plans, state)

    def eviction_order(self, view: PrefillView, state: AdaKVState):
        """Its window votes ranked across all KV heads of the layer, so held heads keep different counts."""
        return [snap_rank(view.stats[i]["window"], state.window, self.kernel, across_heads=True)
                for i in range(view.num_layers)]

    def eviction_order_words(self) -> str:
        return "its window votes ranked across the layer's KV heads, the observation window last"

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, AdaKVState) and state.head_counts:
            out.append(Fact("head_min", "fewest voted entries in one KV head", [min(c) for c in state.head_counts],
                            kind="per-layer", fmt="d"))
            out.append(Fact("head_max", "most in one KV head", [max(c) for c in state.head_counts],
                            kind="per-layer", fmt="d"))
        return out
