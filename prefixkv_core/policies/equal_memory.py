"""Equal-memory mode: prompt-only methods (SnapKV, PyramidKV, LOOK-M, PrefixKV with decode = grow) held at
about r·N_t entries after the prompt and after every token, like the every-step methods, so all budgeted
methods are compared at the same memory.

The rule keeps each method's own choice of prompt entries as long as the budget allows:

1. Layer l holds round(ρ_l · N_t) entries, where ρ_l is the layer's share right after the method compressed
   the prompt, rescaled so the shares average r (PyramidKV keeps its pyramid; LOOK-M, whose text may
   exceed the budget, is brought down to r).
2. When a layer holds more, the oldest generated entries go first (the generated part behaves as a window of
   recent tokens); the newest entry always stays.
3. When that is not enough (the compressed prompt itself is over the target), the prompt entries with the
   lowest accumulated attention (prefill column sums, per KV head) go next; the attention sink and the last
   prompt token always stay.
"""
from __future__ import annotations

import torch

from ..cache import TrackedCache
from .base import DecodeView, LayerPlan, budget_count, drop_range_keep, protected_mask, top_k_keep

MIN_HELD = 3  # the sink, the last prompt token and the newest entry


def layer_shares(cache: TrackedCache, prompt_len: int, budget: float) -> list[float]:
    """Each layer's share of N_t to hold: its prompt entries now over N, rescaled to average `budget`."""
    kept = [int((layer.positions[0, 0] < prompt_len).sum()) for layer in cache.layers]
    mean = sum(kept) / len(kept)
    if mean <= 0:
        return [budget] * len(kept)
    return [budget * k / mean for k in kept]


def hold_plans(view: DecodeView, shares: list[float]) -> list[LayerPlan | None]:
    """Plans that bring layer l to round(shares[l] · N_t) entries (at least MIN_HELD) by the rule above."""
    plans: list[LayerPlan | None] = []
    for layer, share in zip(view.cache.layers, shares):
        target = budget_count(share, view.full_len, min_keep=MIN_HELD)  # r is a share of the uncompressed N_t
        excess = layer.length - target
        if excess <= 0:
            plans.append(None)
            continue
        device = layer.positions.device
        # generated entries (true position >= N) sit after the prompt's in every KV head
        n_prompt = int((layer.positions[0, 0] < view.prompt_len).sum())
        generated = layer.length - n_prompt
        drop_generated = min(excess, max(0, generated - 1))
        rest = excess - drop_generated
        if rest == 0:
            plans.append(LayerPlan(keep=drop_range_keep(layer.length, n_prompt, drop_generated, device)))
            continue
        b, h, _ = layer.positions.shape
        protected = protected_mask(layer, view.prompt_len)[..., :n_prompt]
        prompt_keep = top_k_keep(layer.scores[..., :n_prompt], n_prompt - rest, protected)
        tail = torch.arange(n_prompt + drop_generated, layer.length, device=device).view(1, 1, -1)
        plans.append(LayerPlan(keep=torch.cat([prompt_keep, tail.expand(b, h, -1)], dim=-1)))
    return plans
