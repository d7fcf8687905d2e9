"""The overlay's map: which image tokens a method's compressed cache still holds in one layer, as the share of
KV heads that keep each, placed on the image's views (every crop and newline token of an anyres image)."""
from __future__ import annotations

import torch

from ..kv.cache import TrackedCache
from ..report.events import KeptImageMap
from ..models import ImageLayout
from ..policies import Policy, PolicyState


def kept_image_map(cache: TrackedCache | None, layer: int, image_offset: int | None, layout: ImageLayout | None,
                   policy: Policy, policy_state: PolicyState | None) -> KeptImageMap | None:
    """None when there is no cache (released, failed) or no image in the prompt."""
    if cache is None or image_offset is None or layout is None:
        return None
    lay = cache.layers[layer]
    pos = lay.positions[0]  # [Hkv, T]
    # a vision-side reduction (VisionZip) fed other image tokens: each stands for some of the prompt's
    sources = policy.image_token_sources(policy_state)
    n_tokens = layout.n_tokens if sources is None else sources.tokens
    rel = pos - image_offset
    valid = (rel >= 0) & (rel < n_tokens) & lay.is_image[0]
    counts = torch.zeros(n_tokens)
    counts.index_add_(0, rel[valid].cpu(), torch.ones(int(valid.sum())))
    share = (counts / pos.shape[0]).numpy()
    if sources is None:
        return KeptImageMap(layout, share)
    kept, merged = sources.project(share)
    return KeptImageMap(layout, kept, merged)
