"""What the methods that shrink the image in the vision tower share (VisionZip, VisPruner, PruMerge+): the image
tokens a budget asks for, the record of what each fed token stands for (for the kept-patch overlay and the facts),
and a prefill that plans nothing more (the language model never saw the others)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .base import Fact, Policy, PolicyState, Prefilled, PrefillView
from .image_budget import fed_image_tokens
from .reduction import ImageTokenSources


@dataclass
class VisionReductionState(PolicyState):
    image_tokens: int = 0  # in the prompt
    sources: ImageTokenSources | None = None  # what the language model's image tokens stand for (None: unreduced)
    counts: dict[str, int] = field(default_factory=dict)  # kind -> fed tokens of that kind


@dataclass(frozen=True)
class VisionReductionPolicy(Policy):
    """Base of the vision-side reductions (not a method): a subclass declares `budget_of` and its `vision_plan`."""

    schedule = "prompt only"
    stage = "prefill token reduction"
    control = "random_drop"

    def kept_image_tokens(self, prompt_len: int, image_tokens: int) -> int:
        """Image tokens the language model sees: `cache`, r·N minus the text; `image`, r of the image tokens."""
        return fed_image_tokens(self.budget, self.budget_of, prompt_len, image_tokens)

    def new_state(self) -> VisionReductionState:
        return VisionReductionState()

    def prefill(self, view: PrefillView) -> Prefilled:
        sources = view.reduction if isinstance(view.reduction, ImageTokenSources) else None
        fed = int(view.layer(0).is_image[0, 0].sum())
        state = self.new_state()
        state.image_tokens, state.sources = (sources.original_tokens if sources else fed), sources
        state.counts = dict(sources.counts) if sources else {}
        if sources is None and fed:
            state.notes.append("every image token is kept at this budget")
        return Prefilled([None] * view.num_layers, state)

    def image_token_sources(self, state: PolicyState | None) -> ImageTokenSources | None:
        return state.sources if isinstance(state, VisionReductionState) else None

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, VisionReductionState) and state.sources is not None:
            out += state.sources.fed_facts()
        return out
