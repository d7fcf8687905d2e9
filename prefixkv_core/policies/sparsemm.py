"""SparseMM: a KV budget per head from offline visual-head scores, SnapKV's window votes within each head.

Paper: Wang et al., "SparseMM: Head Sparsity Emerges from Visual Concept Responses in MLLMs", 2025,
https://arxiv.org/abs/2506.05344 (reference code: github.com/CR400AF-A/SparseMM).

Offline, each KV head of each layer is scored by how often its strongest attention falls on the image region the
model is naming (`python -m prefixkv_core calibrate-heads`, shipped for the embedded model in
assets/visual_heads/). At run time the whole model's scored entries, Σ_l Hkv·(C_l - W), are shared among all its
heads: a share `uniform_share` of each head's count evenly (the reference's ratio 0.1), the rest in proportion to the
heads' scores normalised over the model, so the layers holding visual heads keep more (`scored.ScoredPolicy`'s
`weighted` head budget). Within a head, SnapKV's votes choose, the observation window always kept; the reference's
settings for its base: window 32, average pooling of width 5.

Where the reference leaves room or this tool departs (docs/methods.md):
- calibration on the tool's generated scenes, not SynthDoG's OCR (the embedded model reads no text): a generated
  word that names exactly one object's colour or shape makes that object's disc the target, each head whose
  top-1 attention lands in it scores 1/(tokens in the disc), averaged over the scenes (the reference's hit rule);
- scores per KV head (the attention function records each KV head as the mean of its query heads; the reference
  scores query heads and sums them per KV group);
- a head's count is at most N - W and the model's total is met exactly, the excess of a capped head spread over
  the others (the reference truncates, holding less than its budget); the sink is kept, as in SnapKV here;
- a model without scores runs with even weights (every head the same count: SnapKV with average pooling) and says so.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import scoring
from .base import Prefilled, PrefillView, ResolveContext, knob
from .scored import HEAD_BUDGETS, WEIGHTED
from .snapkv import KERNEL_HELP, POOLING_HELP, SnapKVPolicy
from .visual_heads import load_head_scores

NO_SCORES = "no visual-head scores for this model (python -m prefixkv_core calibrate-heads): every head the same count"


@dataclass(frozen=True)
class SparseMMPolicy(SnapKVPolicy):
    """SparseMM: per-head KV budgets from offline visual-head scores, SnapKV's votes within each head.
    Paper: "SparseMM: Head Sparsity Emerges from Visual Concept Responses in MLLMs" (Wang et al., 2025),
    https://arxiv.org/abs/2506.05344"""

    name = "sparsemm"
    label = "SparseMM"
    summary = ("The heads that look at what the model names in an image (scored offline) keep most of the cache; "
               "SnapKV's window votes choose within each head. Compresses the prompt once.")
    colour = "#F9A825"

    kernel: int = knob(5, help=KERNEL_HELP, low=1, high=63, integer=True)
    pooling: str = knob("avg", choices=scoring.POOLINGS, help=POOLING_HELP)
    head_budget: str = knob(WEIGHTED, choices=(WEIGHTED, *HEAD_BUDGETS), label="head budget",
                            help="a layer's entries among its KV heads: weighted = the model's entries shared by the "
                                 "heads' visual scores (the method); uniform = the same count per head; adaptive = "
                                 "all heads' votes ranked together (AdaKV)")
    uniform_share: float = knob(0.1, help="share of each head's count every head keeps before the visual scores "
                                          "share the rest (the reference's ratio)", low=0.0, high=1.0,
                                label="uniform share")
    # [layer][KV head] flattened: the visual-head scores, filled in by `resolve` from assets/visual_heads
    head_scores: tuple = knob((), help="the visual-head scores, layer by layer (filled in from the model's "
                                       "calibration)", low=0.0, sequence=True, editable=False, label="head scores")

    def resolve(self, context: ResolveContext) -> "SparseMMPolicy":
        if self.head_scores:
            return self
        found = load_head_scores(context.model_slug, context.num_layers)
        if found is None:
            return self
        return dataclasses.replace(self, head_scores=tuple(x for row in found.scores for x in row))

    def head_share(self) -> float:
        return self.uniform_share

    def head_weights(self, view: PrefillView, layer: int) -> list[float]:
        heads = view.layer(0).n_kv
        if not self.head_scores:
            return [1.0] * heads
        if len(self.head_scores) != heads * view.num_layers:
            raise ValueError(f"SparseMM has {len(self.head_scores)} head scores; the model has {view.num_layers} "
                             f"layers of {heads} KV heads")
        return list(self.head_scores[layer * heads:(layer + 1) * heads])

    def prefill(self, view: PrefillView) -> Prefilled:
        plans, state = super().prefill(view)
        if self.head_budget == WEIGHTED and not self.head_scores:
            state.notes.append(NO_SCORES)
        return Prefilled(plans, state)

    def eviction_order_words(self) -> str:
        return "its window votes ranked across the model's heads, the observation window last"

