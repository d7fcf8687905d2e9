"""LLaVA-PruMerge+: the vision tower's CLS-attention outliers plus spatially sampled patches, each merged with its
most similar tokens, and one token for everything pruned.

Paper: Shang et al., "LLaVA-PruMerge: Adaptive Token Reduction for Efficient Large Multimodal Models", ICCV 2025,
https://arxiv.org/abs/2403.15388 (reference code: github.com/42Shawn/LLaVA-PruMerge, `token_prune_merge_advanced_plus`).

A prefill token reduction on the vision side (`vision_plan`). In each crop the tower encodes, with a_j the CLS
token's attention to patch j in the feature layer:
- outliers: the patches whose a_j is above Q3 + 1.5·IQR of the crop's a (the interquartile rule), best first;
- spatial samples: every s-th patch of the raster not among them, s = ⌊⌊1/ρ⌋/3⌋ with ρ the outliers' share, so about
  three samples per outlier (the "+" of PruMerge+);
- each kept patch i becomes x_i + Σ_{j ∈ nn_i} a_j·x_j over its `neighbours` tokens with the most cosine-similar keys
  (kept and pruned alike), and one more token Σ_{j pruned} a_j·x_j stands for everything pruned.
The outputs are fed in that order (outliers, samples, the pruned token), as the reference does.

`budget_of = adaptive` keeps what the rule finds, whatever r (the paper: about 25 % of LLaVA-1.5's 576). By default
(`cache`, and `image`), the count is what r asks for: the outliers first (at most that many), spatial samples
evenly spaced fill the rest. Where this tool departs (docs/methods.md): a_j and the keys are the feature layer's,
averaged over heads (the reference builds a one-head attention from the last layer's query and key projections over
all 1,024 channels); anyres images are reduced crop by crop (the reference is LLaVA-1.5's single crop); on towers
whose crops are the language model's own tokens (Qwen's merged 2x2 groups) a merge is the weighted mean, so it
stays on their scale; a crop with no outlier keeps its best patch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .base import knob
from .crop_ranking import crop_scores, per_crop_counts
from .reduction import CropMerge, VisionCrops, VisionPlan
from .vision_reduction import VisionReductionPolicy

BUDGET_OF = ("cache", "image", "adaptive")
BUDGET_OF_HELP = ("what sets the image tokens fed. cache: r of the prompt's KV cache (text included), as for every "
                  "method; image: r of the image tokens; adaptive: the interquartile rule alone, whatever r (the paper)")


def iqr_outliers(scores: np.ndarray) -> int:
    """How many `scores` lie above Q3 + 1.5·IQR (numpy's percentiles, as the reference)."""
    q1, q3 = np.percentile(scores, 25), np.percentile(scores, 75)
    return int((scores > q3 + 1.5 * (q3 - q1)).sum())


def spatial_samples(count: int, taken: set[int], stride: int, want: int | None = None) -> list[int]:
    """Every `stride`-th patch of `count` (stopping before the last, as the reference's arange(0, N - 1, s)) not in
    `taken`; with `want`, the first `want` of them."""
    out = [j for j in range(0, count - 1, max(1, stride)) if j not in taken]
    return out if want is None else out[:want]


def prumerge_crop(scores: torch.Tensor, keys: torch.Tensor, has_cls: bool, keep: int | None, neighbours: int,
                  mean: bool) -> CropMerge:
    """One crop's output tokens. scores [T] (a_j), keys [T, D]; `keep`: the kept patches (None: the adaptive rule)."""
    t = scores.shape[0]
    first = 1 if has_cls else 0
    patches = t - first
    a = scores[first:].float()
    ranked = torch.argsort(a, descending=True, stable=True)  # patch indices, best first
    outliers = max(1, iqr_outliers(a.numpy()))
    if keep is None:
        chosen = ranked[:outliers].tolist()
        stride = int(int(1 / (outliers / patches)) / 3)
        chosen += spatial_samples(patches, set(chosen), stride)
    else:
        chosen = ranked[: min(outliers, keep)].tolist()
        need = keep - len(chosen)
        if need > 0:
            samples = spatial_samples(patches, set(chosen), max(1, (patches - 1) // need), need)
            chosen += samples
            chosen += [j for j in ranked.tolist() if j not in set(chosen)][: keep - len(chosen)]
    unit = F.normalize(keys[first:].float(), dim=-1)
    rows, at = [], []
    for i in chosen:
        similar = unit @ unit[i]
        similar[i] = float("-inf")  # its neighbours, not itself
        nn = torch.topk(similar, min(neighbours, patches - 1)).indices if patches > 1 else torch.zeros(0, dtype=torch.long)
        row = torch.zeros(t)
        row[first + nn] = a[nn]
        row[first + i] += 1.0
        rows.append(row / row.sum() if mean else row)
        at.append(first + i)
    pruned = torch.tensor(sorted(set(range(patches)) - set(chosen)), dtype=torch.long)
    kinds = ["contextual"] * len(rows)
    if pruned.numel():
        row = torch.zeros(t)
        row[first + pruned] = a[pruned]
        rows.append(row / row.sum() if mean and float(row.sum()) > 0 else row)
        at.append(first + int(pruned[0]))
        kinds.append("contextual")
    return CropMerge(torch.stack(rows), kinds, at)


@dataclass(frozen=True)
class PruMergePlusPolicy(VisionReductionPolicy):
    """LLaVA-PruMerge+: CLS-attention outliers (interquartile rule) and spatial samples kept, each merged with its
    most similar tokens, one token for the pruned rest. Paper: "LLaVA-PruMerge: Adaptive Token Reduction for
    Efficient Large Multimodal Models" (Shang et al., ICCV 2025), https://arxiv.org/abs/2403.15388"""

    name = "prumerge_plus"
    label = "PruMerge+"
    summary = ("Prefill token reduction in the vision tower: the patches the CLS token attends to unusually much "
               "(interquartile rule) and evenly spaced ones, each merged with its most similar tokens.")
    colour = "#6D4C41"
    neighbours: int = knob(32, help="tokens merged into each kept patch: those with the most similar keys (the "
                                    "reference's 32)", low=0, high=4096, integer=True)
    budget_of: str = knob("cache", help=BUDGET_OF_HELP, choices=BUDGET_OF, label="budget of")

    def vision_plan(self, crops: VisionCrops) -> VisionPlan | None:
        keys = crops.keys.float().cpu()
        patches = crops.tokens_per_crop - (1 if crops.has_cls else 0)
        if self.budget_of == "adaptive":
            counts = [None] * crops.num_crops
        else:
            wanted = crops.wanted(self.kept_image_tokens)
            if wanted >= crops.image_tokens:
                return None
            # each crop also feeds the token of its pruned patches
            kept = max(crops.num_crops, wanted - crops.num_crops)
            counts = per_crop_counts(kept, crops.num_crops, max(1, patches - 1))
        merges = [prumerge_crop(crop_scores(crops, c), keys[c], crops.has_cls, k, self.neighbours, crops.merged)
                  for c, k in enumerate(counts)]
        return VisionPlan(merges, projected=crops.merged)
