"""VL-Cache: per-layer budgets from the sparsity of the post-vision attention, tokens ranked by the post-vision
queries' attention.

Paper: Tu et al., "VL-Cache: Sparsity and Modality-Aware KV Cache Compression for Vision-Language Model Inference
Acceleration", ICLR 2025, https://arxiv.org/abs/2410.23317 (no official code: the choices below are ours).

The post-vision queries are the prompt's queries after its last image token. (1) Layer budgets: in each layer, the
share of their (causally visible) attention scores below `threshold` times their row's largest (1% in the paper)
is the layer's sparsity; layer l keeps a share of the budget proportional to its density 1 - sparsity, the counts
summing to round(r·N·L) (the integer rounding spread by largest remainders) and each in [2, N]. (2) Token scoring:
a token's score is the attention the post-vision queries pay it, summed over them and averaged over heads; each
layer keeps its top tokens, the sink and a recent window always among them: the last `recent_window` x r x N
prompt tokens (10 % of the budget, at least the last token), as EffiVLM-Bench's VL-Cache protects them;
`recent_window=0` keeps only the sink and the last prompt token. Prompt only: the cache then grows.

Choices: the scores are averaged over every head of a layer (one ranking per layer, as the cache keeps the same
count in every head); the recent window counts within each layer's share (EffiVLM-Bench adds it on top, holding
slightly more than r), one width for every layer, as its default; when the image ends the prompt (no post-vision query), the last query stands for them; a
prompt without an image has every query post-vision.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..kv.attention import StatRequest, post_vision_queries
from . import allocation
from .base import Fact, LayerPlan, Policy, PolicyState, Prefilled, PrefillView, knob, protected_mask, tiered_keep
from .eviction_order import ranked

PROTECTED = 2  # the sink and the last prompt token: the fewest entries a layer keeps


def recent_width(share: float, budget: float, n: int) -> int:
    """The recent window's width: `share` of the budget's r·N entries, at least the last prompt token."""
    return min(n, max(1, int(share * budget * n)))


def recent_mask(n: int, width: int, device=None) -> torch.Tensor:
    """bool [N]: the last `width` prompt positions."""
    return torch.arange(n, device=device) >= n - width


def layer_sparsity(below: torch.Tensor, after_image: torch.Tensor) -> float:
    """One row and layer: below [Hkv, N] (per key, how many post-vision queries gave it a score under the
    threshold), after_image bool [N] (the post-vision queries) -> the share of their visible scores that are
    sparse, averaged over heads (query i sees keys 0 … i)."""
    seen = float((after_image.nonzero().flatten() + 1).sum())
    return float(below.float().sum(dim=-1).mean()) / max(seen, 1.0)


def density_counts(sparsity: list[float], budget: float, n: int) -> list[int]:
    """Per-layer counts proportional to 1 - sparsity, summing to round(r·N·L), each in [min(2, N), N]."""
    total = int(round(budget * n * len(sparsity)))
    density = [max(0.0, 1.0 - s) for s in sparsity]
    return allocation.from_ratios(density, total, low=min(PROTECTED, n), high=n)


@dataclass
class VLCacheState(PolicyState):
    sparsity: list[float] = field(default_factory=list)  # post-vision attention sparsity per layer
    capacities: list[int] = field(default_factory=list)  # entries kept per layer
    post_vision: int = 0  # post-vision queries
    importance: torch.Tensor | None = None  # [L, N] the post-vision scores each layer ranked by
    recent: int = 0  # the recent window's width (entries kept in every layer before the scores rank the rest)


@dataclass(frozen=True)
class VLCachePolicy(Policy):
    """VL-Cache: layer budgets proportional to the density of the post-vision attention, tokens ranked by the
    post-vision queries' attention. Paper: "VL-Cache: Sparsity and Modality-Aware KV Cache Compression for
    Vision-Language Model Inference Acceleration" (Tu et al., ICLR 2025), https://arxiv.org/abs/2410.23317"""

    name = "vlcache"
    label = "VL-Cache"
    summary = ("Layers whose post-vision attention is denser keep more of the budget; each keeps the tokens the "
               "text after the image attends to most. Compresses the prompt once; the cache then grows.")
    colour = "#5D4037"  # brown
    schedule = "prompt only"
    stage = "KV eviction"

    threshold: float = knob(0.01, help="sparsity threshold: a post-vision attention score is sparse below this share "
                                       "of its query's largest score (the paper's 1%)", low=0.0, high=1.0,
                            low_open=True, high_open=True)
    recent_window: float = knob(0.1, help="share of the budget kept as the prompt's most recent tokens in every "
                                          "layer (EffiVLM-Bench's 10%); 0 keeps the sink and the last token only",
                                low=0.0, high=1.0, label="recent window")

    def plans_rows_together(self) -> bool:
        return False  # the per-layer budgets follow each prompt's own sparsity

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(post_vision=self.threshold)

    def prefill(self, view: PrefillView) -> Prefilled:
        if view.layer(0).positions.shape[0] != 1:
            raise ValueError("VL-Cache's per-layer budgets follow one prompt's sparsity: batch size 1 only")
        n = view.prompt_len
        after = post_vision_queries(view.layer(0).is_image[:, 0])[0]
        state = VLCacheState(post_vision=int(after.sum()))
        state.sparsity = [layer_sparsity(view.stats[i]["post_vision_sparse"][0], after)
                          for i in range(view.num_layers)]
        state.capacities = density_counts(state.sparsity, self.budget, n)
        scores = [view.stats[i]["post_vision"].mean(dim=1, keepdim=True) for i in range(view.num_layers)]
        state.importance = torch.cat([s[0] for s in scores])
        state.recent = recent_width(self.recent_window, self.budget, n) if self.recent_window > 0 else 0
        # tier 0: the sink and the last token; 1: the recent window; 2: the rest, by score
        tier = 2 - recent_mask(n, state.recent, scores[0].device).long()
        plans = [LayerPlan(keep=tiered_keep(s, k, torch.where(protected_mask(view.layer(i), n)[:, :1], 0, tier)))
                 for i, (s, k) in enumerate(zip(scores, state.capacities))]
        over = sum(state.capacities) - int(round(self.budget * n * view.num_layers))
        if over > 0:
            state.notes.append(f"every layer keeps the sink and the last prompt token: {over} entries over r·N·L")
        return Prefilled(plans, state)

    def eviction_order(self, view: PrefillView, state: PolicyState):
        """Its post-vision scores order the prompt's eviction (held at r·N_t in equal-memory mode)."""
        n = view.prompt_len
        recent = recent_mask(n, state.recent if isinstance(state, VLCacheState) else 0, view.layer(0).positions.device)
        return [ranked(view.stats[i]["post_vision"].mean(dim=1, keepdim=True), recent)
                for i in range(view.num_layers)]

    def eviction_order_words(self) -> str:
        return "its post-vision attention, in its per-layer counts"

    def allocation_importance(self, state: PolicyState) -> torch.Tensor | None:
        return state.importance if isinstance(state, VLCacheState) else None

    @classmethod
    def curves_note(cls, knobs: dict[str, Any]) -> str | None:
        return f"{cls.label}'s curves: post-vision attention"

    def facts(self, state: PolicyState) -> list[Fact]:
        out: list[Fact] = []
        if isinstance(state, VLCacheState) and state.capacities:
            out.append(Fact("capacities", "capacity", list(state.capacities), kind="per-layer", fmt="d",
                            unit=" entries"))
            out.append(Fact("sparsity", "post-vision sparsity", [round(s, 4) for s in state.sparsity],
                            kind="per-layer", fmt=".0%"))
            out.append(Fact("post_vision", "post-vision queries", state.post_vision, fmt="d"))
            out.append(Fact("recent", "recent window", state.recent, fmt="d", unit=" entries"))
        return out + super().facts(state)
