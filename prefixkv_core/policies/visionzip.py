"""VisionZip: the language model sees a few dominant image tokens and a few contextual ones, chosen in the vision tower.

Paper: Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models", CVPR 2025,
https://arxiv.org/abs/2412.04467.

A prefill token reduction on the vision side: in each crop the vision tower encodes, the tokens the feature layer
attends to most are kept as they are (dominant: the attention the CLS token pays them; for towers without a CLS
token, such as SigLIP, the attention they receive from every token), and the rest are merged into a few
contextual tokens by key similarity. The runner (`vision_tokens`) feeds the language model the shorter image
block; nothing is evicted afterwards, and generated tokens are all kept. On Qwen's towers the crops' tokens are
the merged 2x2 groups (`VisionCrops.merged`, `decoding.qwen_vision`): the plan weighs the language model's own image
embeddings, and a contextual token is a weighted mean (the reference's sum, halved). On InternVL's tower the crops'
tokens are the pixel-shuffled 2x2 groups the projector reads (`decoding.internvl_vision`), ranked by the CLS token's
attention pooled over each group (`VisionCrops.cls_attention`), merged before the projector as on LLaVA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Fact, PolicyState, Prefilled, PrefillView, knob
from .crop_ranking import dominant_scores, first_best, per_crop_counts
from .image_budget import BUDGET_OF
from .reduction import CropMerge, VisionCrops, VisionPlan
from .vision_reduction import VisionReductionPolicy, VisionReductionState

CONTEXTUAL_HELP = ("share of each crop's kept tokens that are contextual (merged) tokens; the paper's settings keep "
                   "10 of 64, 20 of 128 and 30 of 192")
BUDGET_OF_HELP = ("what the budget r is a share of. cache: the prompt's KV cache (text included), as for every "
                  "method; image: the prompt's image tokens (the paper's 64, 128 or 192 of 576)")


def contextual_merge(keys: torch.Tensor, rest: torch.Tensor, count: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The reference's contextual tokens over the `rest` token indices (ascending): `count` anchors sampled evenly
    (every max(1, len // count)-th), every other token assigned to the anchor whose key is most cosine-similar
    (ties to the first anchor). -> (anchors [count], the tokens merged into each)."""
    count = min(count, rest.numel())
    step = max(1, rest.numel() // count)
    slots = torch.arange(0, rest.numel(), step)[:count]
    anchors = rest[slots]
    others = rest[~torch.isin(torch.arange(rest.numel()), slots)]
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    nearest = (unit[others] @ unit[anchors].T).argmax(dim=-1) if others.numel() else others
    return anchors, [others[nearest == j] for j in range(count)]


def crop_merge(attention: torch.Tensor, keys: torch.Tensor, has_cls: bool, dominant: int, contextual: int,
               mean: bool = False, scores: torch.Tensor | None = None) -> CropMerge:
    """One crop's output tokens: its CLS token (when it has one) and the top patches by `dominant_scores` (or by
    `scores` [T] where given: a CLS token outside the crop's tokens, InternVL's) (together `dominant` tokens), then
    `contextual` tokens, each its anchor plus the mean of the tokens merged into it (with `mean`, that sum halved:
    a weighted mean that stays on the scale of tokens fed as they are, as the language model's own embeddings on
    Qwen)."""
    t = attention.shape[0]
    first = 1 if has_cls else 0
    ranked = dominant_scores(attention, has_cls) if scores is None else scores
    picked = first_best(ranked[first:], max(0, dominant - first)) + first
    rows, kinds, at = [], [], []
    if has_cls:
        rows.append(torch.nn.functional.one_hot(torch.tensor(0), t).float())
        kinds.append("cls")
        at.append(0)
    for i in picked.tolist():
        rows.append(torch.nn.functional.one_hot(torch.tensor(i), t).float())
        kinds.append("dominant")
        at.append(i)
    rest = torch.tensor(sorted(set(range(first, t)) - set(picked.tolist())), dtype=torch.long)
    if contextual > 0 and rest.numel():
        anchors, groups = contextual_merge(keys, rest, contextual)
        for anchor, group in zip(anchors.tolist(), groups):
            row = torch.zeros(t)
            if group.numel():
                row[group] = 1.0 / group.numel()
            row[anchor] = 1.0
            rows.append(row / row.sum() if mean else row)
            kinds.append("contextual")
            at.append(anchor)
    return CropMerge(torch.stack(rows), kinds, at)


@dataclass(frozen=True)
class VisionZipPolicy(VisionReductionPolicy):
    """VisionZip: dominant image tokens kept and the rest merged into contextual tokens in the vision tower, so the
    language model sees fewer image tokens. Paper: "VisionZip: Longer is Better but Not Necessary in Vision
    Language Models" (Yang et al., CVPR 2025), https://arxiv.org/abs/2412.04467"""

    name = "visionzip"
    label = "VisionZip"
    summary = ("Prefill token reduction in the vision tower: per crop, the most attended tokens stay and the rest "
               "are merged into a few contextual tokens, so the language model sees fewer image tokens.")
    colour = "#A6761D"

    contextual: float = knob(10 / 64, help=CONTEXTUAL_HELP, low=0.0, high=1.0, high_open=True)
    budget_of: str = knob("cache", help=BUDGET_OF_HELP, choices=BUDGET_OF)

    def vision_plan(self, crops: VisionCrops) -> VisionPlan | None:
        wanted = crops.wanted(self.kept_image_tokens)
        if wanted >= crops.image_tokens:
            return None  # as many as the model's own path feeds: nothing to reduce
        counts = per_crop_counts(max(wanted, crops.num_crops), crops.num_crops, crops.tokens_per_crop)
        attention, keys = crops.attention.float().cpu(), crops.keys.float().cpu()  # small: one [T, T] per crop
        cls = crops.cls_attention.float().cpu() if crops.cls_attention is not None else None
        merges = []
        for c, k in enumerate(counts):
            contextual = int(round(self.contextual * k)) if k > 1 else 0
            dominant = max(1, k - contextual)
            merges.append(crop_merge(attention[c], keys[c], crops.has_cls, dominant, k - dominant, crops.merged,
                                     None if cls is None else cls[c]))
        return VisionPlan(merges, projected=crops.merged)

    def prefill(self, view: PrefillView) -> Prefilled:
        plans, state = super().prefill(view)
        sources = state.sources
        if sources is not None:
            full_prompt = view.prompt_len - sources.tokens + sources.original_tokens
            wanted = self.kept_image_tokens(full_prompt, sources.original_tokens)
            if wanted < sources.tokens:  # the budget asked for less than one token per crop
                state.notes.append(f"at least one image token per crop: {sources.tokens} fed where r = "
                                   f"{self.budget:.0%} leaves room for {max(0, wanted)}")
        return Prefilled(plans, state)

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, VisionReductionState) and state.sources is not None:
            s = state.sources
            kept = s.counts.get("dominant", 0) + s.counts.get("cls", 0)
            out.append(Fact("dominant", "dominant", kept, fmt="d",
                            unit=" (CLS included)" if s.counts.get("cls") else ""))
            out.append(Fact("contextual", "contextual", s.counts.get("contextual", 0), fmt="d",
                            unit=f" over {s.crops} crops" if s.crops > 1 else ""))
        return out
