"""MixKV's mix of importance with diversity, per KV head, over any scorer's scores (`scored.ScoredPolicy`'s `mix`).

Paper: Liu et al., "Mixing Importance with Diversity: Joint Optimization for KV Cache Compression in Large
Vision-Language Models", 2025, https://arxiv.org/abs/2510.20707 (reference: github.com/xuyang-liu16/MixKV).

For the prompt entries before the observation window, in each KV head:
- diversity d_j = -cos(k_j, k̄), k̄ the mean of the head's normalised keys over the whole prompt (window in);
- the value norm ‖v_j‖ joins the scorer's importance (the reference's `importance = attention + vnorm`);
- both are min-max normalised over the entries and rescaled to the mean of the scorer's scores, so the mix does
  not depend on the scorer's scale;
- the head's redundancy ρ = mean cosine between two distinct normalised keys, (N·‖k̄‖² - 1) / (N - 1), weighs
  them: ρ·d + (1 - ρ)·(importance + value norm). A redundant head (similar keys) is ranked by diversity, a
  diverse head by importance.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MIXES = ("none", "mixkv")
EPS = 1e-8  # the reference's guard in its rescaling (here also in the min-max, so a constant head gives 0)


def _minmax(x: torch.Tensor) -> torch.Tensor:
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    return (x - low) / (high - low + EPS)


def _to_scale(x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """x rescaled so its mean over the entries is `reference`'s mean."""
    return x * reference.mean(dim=-1, keepdim=True) / (x.mean(dim=-1, keepdim=True) + EPS)


def head_redundancy(keys: torch.Tensor) -> torch.Tensor:
    """keys [B, Hkv, N, D] -> [B, Hkv, 1]: the mean cosine similarity of two distinct keys of a head."""
    n = keys.shape[2]
    mean = F.normalize(keys.float(), dim=-1).mean(dim=2)
    return ((n * mean.pow(2).sum(dim=-1) - 1) / max(n - 1, 1)).unsqueeze(-1)


def mixkv_scores(importance: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """importance [B, 1|Hkv, M] (finite scores of the first M entries), keys and values [B, Hkv, N, D] of the whole
    prompt -> [B, Hkv, M] MixKV's mixed scores of those M entries."""
    m = importance.shape[-1]
    unit = F.normalize(keys.float(), dim=-1)
    mean = unit.mean(dim=2, keepdim=True)  # [B, Hkv, 1, D]
    importance = importance.float().expand(keys.shape[0], keys.shape[1], m)
    diversity = _to_scale(_minmax(-(unit[:, :, :m] * mean).sum(dim=-1)), importance)
    value_norm = _to_scale(_minmax(values[:, :, :m].float().norm(dim=-1)), importance)
    rho = head_redundancy(keys)
    return rho * diversity + (1 - rho) * (importance + value_norm)
