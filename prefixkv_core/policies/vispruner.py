"""VisPruner: the image tokens the vision tower finds important, then diverse ones, chosen in the tower.

Paper: Zhang et al., "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token Pruning in VLMs",
ICCV 2025, https://arxiv.org/abs/2412.01818 (reference code: github.com/Theia-4869/VisPruner).

A prefill token reduction on the vision side (`vision_plan`, as VisionZip's): in each crop the tower encodes, of the
k tokens it may feed, a share `important` are the patches the feature layer's CLS token attends to most (averaged
over heads; without a CLS token, the attention each receives); the others are diverse: from the remaining patches,
in that ranking's order, rounds of duplicate removal each split the candidates alternately in two (a and b), score
every a by its largest cosine similarity to a b, and drop the 8 most duplicated a's (fewer in the last round), until
k remain. The kept patches are fed as they are, in raster order; the CLS token is not fed (the reference's
`patch` features). Generated tokens are all kept.

Where this tool departs (docs/methods.md): the similarity is between the feature layer's keys (averaged over heads,
what the tower hands every vision-side reduction here; the reference: its output hidden states); an odd number of
candidates is split with the extra one in a (the reference's index shapes then fail); the budget is r of the
prompt's cache by default (`budget_of = image`: r of the image tokens, the paper's 64, 128 or 192 of 576).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Fact, PolicyState, knob
from .crop_ranking import crop_scores, per_crop_counts
from .image_budget import BUDGET_OF
from .reduction import CropMerge, VisionCrops, VisionPlan
from .vision_reduction import VisionReductionPolicy, VisionReductionState

ROUND = 8  # duplicates dropped per round (the reference's)
BUDGET_OF_HELP = ("what the budget r is a share of. cache: the prompt's KV cache (text included), as for every "
                  "method; image: the prompt's image tokens (the paper's 64, 128 or 192 of 576)")


def diverse_tokens(candidates: torch.Tensor, keys: torch.Tensor, count: int) -> torch.Tensor:
    """The reference's duplicate removal: `candidates` (token indices, in ranking order), keys [T, D] -> `count` of
    them. Each round splits the candidates alternately into a (even places) and b (odd), scores every a by its
    largest cosine similarity to a b, drops the `ROUND` highest (fewer to land on `count`), and goes on with the
    other a's by that score (highest first), then the b's."""
    unit = F.normalize(keys.float(), dim=-1)
    residual = candidates
    while count > 0:
        drop = min(ROUND, residual.numel() - count)
        if drop <= 0:
            break
        a, b = residual[0::2], residual[1::2]
        similar = (unit[a] @ unit[b].T).amax(dim=-1) if b.numel() else torch.zeros(a.numel())
        order = torch.argsort(similar, descending=True, stable=True)
        residual = torch.cat([a[order[drop:]], b])
    return residual[:count] if count > 0 else residual[:0]


def vispruner_crop(scores: torch.Tensor, keys: torch.Tensor, has_cls: bool, keep: int, important: float
                   ) -> CropMerge:
    """One crop: `keep` of its patches (the CLS token, when there is one, is not fed): the int(keep · important)
    best by `scores` [T], then the diverse ones, in raster order."""
    t = scores.shape[0]
    first = 1 if has_cls else 0
    ranked = torch.argsort(scores[first:].float(), descending=True, stable=True) + first
    n_important = min(int(keep * important), ranked.numel())
    chosen = ranked[:n_important]
    diverse = diverse_tokens(ranked[n_important:], keys, min(keep - n_important, ranked.numel() - n_important))
    kinds = {int(i): "dominant" for i in chosen} | {int(i): "diverse" for i in diverse}
    at = sorted(kinds)
    weights = torch.zeros(len(at), t)
    weights[torch.arange(len(at)), torch.tensor(at, dtype=torch.long)] = 1.0
    return CropMerge(weights, [kinds[i] for i in at], at)


@dataclass(frozen=True)
class VisPrunerPolicy(VisionReductionPolicy):
    """VisPruner: the patches the vision tower's CLS token attends to most, then diverse ones by removing duplicates,
    are the image tokens the language model sees. Paper: "Beyond Text-Visual Attention: Exploiting Visual Cues for
    Effective Token Pruning in VLMs" (Zhang et al., ICCV 2025), https://arxiv.org/abs/2412.01818"""

    name = "vispruner"
    label = "VisPruner"
    summary = ("Prefill token reduction in the vision tower: per crop, the patches its CLS token attends to most, "
               "then patches unlike the rest (duplicates removed), are the image tokens the language model sees.")
    colour = "#3949AB"
    important: float = knob(0.5, help="share of each crop's kept tokens chosen by the CLS token's attention, the rest "
                                      "for diversity (the reference's important_ratio)", low=0.0, high=1.0)
    budget_of: str = knob("cache", help=BUDGET_OF_HELP, choices=BUDGET_OF, label="budget of")

    def vision_plan(self, crops: VisionCrops) -> VisionPlan | None:
        wanted = crops.wanted(self.kept_image_tokens)
        if wanted >= crops.image_tokens:
            return None
        limit = crops.tokens_per_crop - (1 if crops.has_cls else 0)
        counts = per_crop_counts(max(wanted, crops.num_crops), crops.num_crops, limit)
        keys = crops.keys.float().cpu()
        merges = [vispruner_crop(crop_scores(crops, c), keys[c], crops.has_cls, k, self.important)
                  for c, k in enumerate(counts)]
        return VisionPlan(merges, projected=crops.merged)

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, VisionReductionState) and state.sources is not None:
            s = state.sources
            out.append(Fact("important", "important (CLS attention)", s.counts.get("dominant", 0), fmt="d"))
            out.append(Fact("diverse", "diverse (duplicates removed)", s.counts.get("diverse", 0), fmt="d",
                            unit=f" over {s.crops} crops" if s.crops > 1 else ""))
        return out
