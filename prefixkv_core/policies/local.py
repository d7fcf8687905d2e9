"""Local (StreamingLLM): keep the attention-sink token(s) and the most recent tokens."""
from __future__ import annotations

from dataclasses import dataclass

from .base import DecodeView, LayerPlan, Policy, PrefillView, budget_count, drop_range_keep


@dataclass
class LocalPolicy(Policy):
    name = "local"
    label = "Local (StreamingLLM)"
    summary = "Sink token + most recent tokens; the oldest non-sink tokens are evicted. Uniform over layers."

    sinks: int = 1

    def _plans(self, cache, true_len: int) -> list[LayerPlan | None]:
        target = budget_count(self.budget, true_len, min_keep=self.sinks + 1)
        plans: list[LayerPlan | None] = []
        for layer in cache.layers:
            excess = layer.length - target
            # entries are in position order, so the oldest non-sink ones sit right after the sinks
            plans.append(
                LayerPlan(keep=drop_range_keep(layer.length, self.sinks, excess, layer.positions.device))
                if excess > 0
                else None
            )
        return plans

    def prefill(self, view: PrefillView):
        return self._plans(view.cache, view.prompt_len)

    def decode(self, view: DecodeView):
        return self._plans(view.cache, view.true_len)
