"""Local (StreamingLLM): keep the attention-sink token(s) and the most recent tokens.

Every layer keeps the same count (`allocation.uniform`), the newest entries (`scoring.recency`) and the first
`sinks` positions."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import allocation, scoring
from .base import DecodeView, LayerPlan, Policy, PolicyState, Prefilled, PrefillView, RangeDrop, knob, \
    plans_by_equal_count, top_k_keep


@dataclass(frozen=True)
class LocalPolicy(Policy):
    """Local: StreamingLLM's attention sinks plus a window of the most recent tokens.
    Paper: "Efficient Streaming Language Models with Attention Sinks" (Xiao et al., 2023),
    https://arxiv.org/abs/2309.17453"""

    name = "local"
    label = "Local (StreamingLLM)"
    summary = ("Attention-sink tokens (4, as published) + the most recent tokens; the oldest non-sink tokens are "
               "evicted. Uniform over layers.")
    colour = "#56B4E9"
    stage = "KV eviction"

    sinks: int = knob(4, help="attention-sink tokens always kept (the paper keeps 4)", low=1, high=64, integer=True)

    def _plans(self, cache, true_len: int) -> list[LayerPlan | None]:
        targets = allocation.uniform(self.budget, true_len, len(cache.layers), min_keep=self.sinks + 1)

        def keep(layers, target):  # the newest entries of the stacked layers, the sinks forced
            positions = torch.stack([layer.positions[:, :1] for layer in layers])  # [L, B, 1, T]
            return top_k_keep(scoring.recency(positions), target, positions < self.sinks)

        return plans_by_equal_count(cache, targets, keep)

    def prefill(self, view: PrefillView) -> Prefilled:
        return Prefilled(self._plans(view.cache, view.prompt_len), PolicyState())

    def decode(self, view: DecodeView, state: PolicyState):
        # A layer's entries ascend in position, and every position below `sinks` the sequence has reached is one
        # of its first entries (forced, so never dropped): the oldest non-sink entries it sheds are one range right
        # after them, the same plan as ranking by recency, carried out without ranking (`RangeDrop`).
        targets = allocation.uniform(self.budget, view.true_len, len(view.cache.layers), min_keep=self.sinks + 1)
        sinks = min(self.sinks, view.true_len)
        return [RangeDrop(layer.length, sinks, layer.length - target, layer.entries_device)
                if layer.length > target else None for layer, target in zip(view.cache.layers, targets)]
