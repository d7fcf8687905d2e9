"""Local (StreamingLLM): keep the attention-sink token(s) and the most recent tokens."""
from __future__ import annotations

from dataclasses import dataclass

from .base import DecodeView, LayerPlan, Policy, PolicyState, Prefilled, PrefillView, budget_count, \
    drop_range_keep, knob


@dataclass(frozen=True)
class LocalPolicy(Policy):
    name = "local"
    label = "Local (StreamingLLM)"
    summary = "Sink token + most recent tokens; the oldest non-sink tokens are evicted. Uniform over layers."
    colour = "#56B4E9"

    sinks: int = knob(1, help="attention-sink tokens always kept", low=1, high=64, integer=True)

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

    def prefill(self, view: PrefillView) -> Prefilled:
        return Prefilled(self._plans(view.cache, view.prompt_len), PolicyState())

    def decode(self, view: DecodeView, state: PolicyState):
        return self._plans(view.cache, view.true_len)
