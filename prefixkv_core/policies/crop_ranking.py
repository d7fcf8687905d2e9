"""How the vision-side reductions rank and share out one image's crops (VisionZip, VisPruner, PruMerge+): the
attention a crop's tokens get in the vision tower's feature layer, and counts spread over crops."""
from __future__ import annotations

import torch


def first_best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores (ties to the lower index), ascending."""
    return torch.argsort(scores.float(), descending=True, stable=True)[:k].sort().values


def dominant_scores(attention: torch.Tensor, has_cls: bool) -> torch.Tensor:
    """attention [T, T] of one crop (averaged over heads) -> [T] how much each token matters: the CLS token's
    attention to it, or, without a CLS token, the attention it receives averaged over every query."""
    return attention[0] if has_cls else attention.mean(dim=0)


def crop_scores(crops, c: int) -> torch.Tensor:
    """[T] crop c's tokens ranked by the tower: a CLS token outside the crop's tokens where the tower has one
    (InternVL's, `cls_attention`), else `dominant_scores` (CPU fp32)."""
    if crops.cls_attention is not None:
        return crops.cls_attention[c].float().cpu()
    return dominant_scores(crops.attention[c].float().cpu(), crops.has_cls)


def per_crop_counts(total: int, crops: int, limit: int) -> list[int]:
    """`total` tokens over `crops` crops as evenly as possible (the first ones take the remainder), each in
    [1, limit]."""
    base, extra = divmod(total, crops)
    return [max(1, min(limit, base + (1 if c < extra else 0))) for c in range(crops)]
