"""H2O (Heavy-Hitter Oracle): keep the tokens with the largest accumulated attention, plus a recent window.

Every layer keeps the same count (`allocation.uniform`), ranked by the accumulated column sums (the prefill's plus
every decoding query's attention, `scoring.accumulated`), the sink, the last prompt token and a recent window
always among them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.attention import StatRequest
from . import allocation, scoring
from .base import DecodeView, LayerPlan, Policy, PolicyState, Prefilled, PrefillView, knob, plans_by_equal_count, \
    protected_positions, top_k_keep


@dataclass(frozen=True)
class H2OPolicy(Policy):
    """H2O: heavy hitters by accumulated attention plus the most recent tokens, half of the budget each.
    Paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
    (Zhang et al., 2023), https://arxiv.org/abs/2306.14048"""

    name = "h2o"
    label = "H2O"
    summary = ("Accumulated attention (prefill column sums + every decoding query) picks heavy hitters; "
               "a recent window (half the budget, as published) protects new tokens. Uniform count over layers.")
    colour = "#E69F00"
    stage = "KV eviction"

    recent_fraction: float = knob(0.5, help="share of the budget kept for the most recent tokens (at least one; "
                                            "the paper splits the budget half and half)",
                                  low=0.0, high=1.0)

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(colsum=True)

    def decode_needs_attention(self) -> bool:
        return True

    def _plans(self, cache, true_len: int, prompt_len: int) -> list[LayerPlan | None]:
        targets = allocation.uniform(self.budget, true_len, len(cache.layers), min_keep=2)

        def keep(layers, target):  # heavy hitters over the stacked layers, the sink and a recent window forced
            scores = torch.stack([layer.scores for layer in layers])  # [L, B, Hkv, T]
            heat = scoring.accumulated(scores.flatten(0, 1)).view(len(layers), scores.shape[1], 1, scores.shape[3])
            forced = protected_positions(torch.stack([layer.positions[:, :1] for layer in layers]), prompt_len)
            forced[..., -max(1, int(round(self.recent_fraction * target))):] = True
            return top_k_keep(heat, target, forced)

        return plans_by_equal_count(cache, targets, keep)

    def prefill(self, view: PrefillView) -> Prefilled:
        return Prefilled(self._plans(view.cache, view.prompt_len, view.prompt_len), PolicyState())

    def decode(self, view: DecodeView, state: PolicyState):
        return self._plans(view.cache, view.true_len, view.prompt_len)
