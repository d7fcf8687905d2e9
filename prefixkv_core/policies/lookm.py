"""LOOK-M: text-prior selection (a recent window, then text ranked before image tokens) per KV head, then each
evicted token is merged into the kept token whose key is most similar.

The budget splits in half: r/2 recent tokens and r/2 heavy hitters, ranked per KV head by the prefill's column
sums with every text token before the image tokens; then the merge. `text_prior = keep_all` keeps every text token
on top of the budget instead of ranking it."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kv.attention import StatRequest
from . import scoring
from .base import (LayerPlan, Merge, Policy, PolicyError, PolicyState, Prefilled, PrefillView, budget_count, knob,
                   tiered_keep, top_k_keep)
from .eviction_order import HoldRank

MERGE_MODES = ("pivotal", "average", "weighted")
TEXT_PRIORS = ("rank", "keep_all")


def lookm_keep(scores: torch.Tensor, is_image: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """scores/is_image [B, H, N] -> kept indices [B, H, K] ascending.

    Keeps the last `recent` entries, every text entry, and image entries by score until `heavy` entries
    outside the recent window are kept (text first). If text alone exceeds `heavy`, all text stays."""
    n = scores.shape[-1]
    recent = min(recent, n)
    pool = n - recent
    text = ~is_image[..., :pool]
    n_text = int(text[0, 0].sum()) if pool > 0 else 0
    k = min(pool, max(heavy, n_text))
    chosen = top_k_keep(scores[..., :pool], k, forced=text)
    tail = torch.arange(pool, n, device=scores.device).view(1, 1, -1).expand(scores.shape[0], scores.shape[1], -1)
    return torch.cat([chosen, tail], dim=-1)


def lookm_rank_keep(scores: torch.Tensor, is_image: torch.Tensor, positions: torch.Tensor, heavy: int,
                    recent: int) -> torch.Tensor:
    """Like `lookm_keep`, but within the budget: the last `recent` entries, then exactly `heavy` more ranked
    sink first, then text, then image, each by score. -> [B, H, min(n, heavy + recent)] ascending."""
    n = scores.shape[-1]
    recent = min(recent, n)
    pool = n - recent
    tier = torch.where(positions[..., :pool] < 1, 0, torch.where(is_image[..., :pool], 2, 1))
    chosen = tiered_keep(scores[..., :pool], min(heavy, pool), tier)
    tail = torch.arange(pool, n, device=scores.device).view(1, 1, -1).expand(scores.shape[0], scores.shape[1], -1)
    return torch.cat([chosen, tail], dim=-1)


def similarity_merge(keys: torch.Tensor, keep: torch.Tensor, mode: str) -> Merge | None:
    """Match every evicted entry to the kept entry with the most cosine-similar key (per head)."""
    b, h, n, _ = keys.shape
    kept_flag = torch.zeros(b, h, n, dtype=torch.bool, device=keys.device)
    kept_flag.scatter_(2, keep, True)
    n_evicted = n - keep.shape[-1]
    if n_evicted <= 0:
        return None
    evicted = torch.argsort(kept_flag.to(torch.int8), dim=-1, stable=True)[..., :n_evicted]  # False first
    kn = F.normalize(keys.float(), dim=-1)
    k_kept = kn.gather(2, keep[..., None].expand(-1, -1, -1, kn.shape[-1]))
    k_ev = kn.gather(2, evicted[..., None].expand(-1, -1, -1, kn.shape[-1]))
    sim = torch.matmul(k_ev, k_kept.transpose(-1, -2))  # [B, H, E, K]
    best_sim, best = sim.max(dim=-1)
    dst = keep.gather(2, best)
    matched = torch.zeros(b, h, n, device=keys.device).scatter_add_(2, dst, torch.ones_like(best_sim))
    if mode == "average":
        src_w, self_w = torch.ones_like(best_sim), torch.ones(b, h, n, device=keys.device)
    elif mode == "pivotal":
        # mean of {k_j} ∪ {(k_e + k_j)/2}: k_j weighs 1 + n_j/2, each k_e weighs 1/2
        src_w, self_w = torch.full_like(best_sim, 0.5), 1.0 + 0.5 * matched
    elif mode == "weighted":
        # Eq. 12: k_j <- (k_j + sum_e s_e k_e) / (n_j + 1), the similarities as they are (not clamped, not
        # renormalised), as the paper writes it and its reference code computes it
        return Merge(src=evicted, dst=dst, src_weight=best_sim, self_weight=torch.ones(b, h, n, device=keys.device),
                     denominator=1.0 + matched)
    else:
        raise PolicyError(f"unknown LOOK-M merge mode {mode!r}; accepted: {', '.join(MERGE_MODES)}")
    return Merge(src=evicted, dst=dst, src_weight=src_w, self_weight=self_w)


@dataclass(frozen=True)
class LookMPolicy(Policy):
    """LOOK-M (Wan et al., 2024): text-prior KV eviction with merging of the evicted entries.
    Paper: "LOOK-M: Look-Once Optimization in KV Cache for Efficient Multimodal Long-Context Inference",
    https://arxiv.org/abs/2406.18139"""

    name = "lookm"
    label = "LOOK-M"
    summary = ("Text-prior: a recent window (r/2) and r/2 more ranked text first, then image tokens by "
               "attention, per KV head; evicted tokens are merged into the most similar kept key. Prompt only.")
    colour = "#8C564B"
    schedule = "prompt only"
    stage = "KV merging"

    merge: str = knob("pivotal", help="how evicted tokens are merged into the most similar kept ones",
                      choices=MERGE_MODES)
    text_prior: str = knob("rank", help="rank: text ranked before image tokens inside the budget (the paper); "
                                        "keep_all: every text token stays, even past the budget",
                           choices=TEXT_PRIORS, label="text prior")

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(colsum=True)

    def prefill(self, view: PrefillView) -> Prefilled:
        n = view.prompt_len
        recent = max(1, int(round(0.5 * self.budget * n)))
        if self.text_prior == "rank":  # exactly the budget: what the recent window leaves goes to the ranking
            heavy = max(0, budget_count(self.budget, n) - recent)
        else:
            heavy = int(round(0.5 * self.budget * n))
        plans = []
        over = 0
        for i in range(view.num_layers):
            layer = view.layer(i)
            scores = scoring.colsum(view.stats[i]["colsum"], per_head=True)
            if self.text_prior == "rank":
                keep = lookm_rank_keep(scores, layer.is_image, layer.positions, heavy, recent)
            else:
                keep = lookm_keep(scores, layer.is_image, heavy, recent)
            over = max(over, keep.shape[-1] - int(round(self.budget * n)))
            plans.append(LayerPlan(keep=keep, merge=similarity_merge(layer.keys, keep, self.merge)))
        state = PolicyState()
        if over > 0:
            state.notes.append(f"text tokens alone exceed the budget: {over} entries over r·N per layer")
        return Prefilled(plans, state)

    def eviction_order(self, view: PrefillView, state: PolicyState):
        """Its own order: its recent window, then text, then image tokens, each by accumulated attention, per KV
        head; what it evicts is merged into the kept entry with the most similar key, as its prefill does."""
        n = view.prompt_len
        recent = max(1, int(round(0.5 * self.budget * n)))
        merge = functools.partial(similarity_merge, mode=self.merge)
        ranks = []
        for i in range(view.num_layers):
            layer = view.layer(i)
            scores = scoring.colsum(view.stats[i]["colsum"], per_head=True)
            tiers = torch.where(layer.positions >= n - recent, 0, torch.where(layer.is_image, 2, 1))
            ranks.append(HoldRank(scores.float(), tiers, merge=merge))
        return ranks

    def eviction_order_words(self) -> str:
        return "its own order (its recent window, then text, then image tokens, by attention), merged"
