"""The overlay's map: which image tokens a method's compressed cache still holds in one layer, as the share of
KV heads that keep each, placed on the views of every image (every crop and newline token of an anyres image,
every frame of a video)."""
from __future__ import annotations

import numpy as np
import torch

from ..kv.cache import TrackedCache
from ..report.events import KeptImageMap
from ..models import ImageLayout
from ..policies import Policy, PolicyState


def fed_image_positions(image_positions: np.ndarray, sources) -> np.ndarray:
    """The positions of the image tokens the language model was fed: the prompt's own, or those a vision-side
    reduction fed instead (its record says where; else they follow the first image token)."""
    if sources is None:
        return image_positions
    if getattr(sources, "positions", None) is not None:
        return np.asarray(sources.positions)
    return int(image_positions[0]) + np.arange(sources.tokens)


def kept_image_map(cache: TrackedCache | None, layer: int, image_positions: np.ndarray | None,
                   layout: ImageLayout | None, policy: Policy, policy_state: PolicyState | None
                   ) -> KeptImageMap | None:
    """`image_positions`: the prompt's image tokens' positions, ascending. None when there is no cache (released,
    failed) or no image in the prompt."""
    if cache is None or image_positions is None or not len(image_positions) or layout is None:
        return None
    lay = cache.layers[layer]
    pos = lay.positions[0].cpu().contiguous()  # [Hkv, T]
    # a vision-side reduction (VisionZip) fed other image tokens: each stands for some of the prompt's
    sources = policy.image_token_sources(policy_state)
    fed = torch.as_tensor(fed_image_positions(image_positions, sources), dtype=pos.dtype)
    at = torch.searchsorted(fed, pos).clamp(max=fed.numel() - 1)  # an entry's index among the fed image tokens
    valid = (fed[at] == pos) & lay.is_image[0].cpu()
    counts = torch.zeros(fed.numel())
    counts.index_add_(0, at[valid], torch.ones(int(valid.sum())))
    share = (counts / pos.shape[0]).numpy()
    if sources is None:
        return KeptImageMap(layout, share)
    kept, merged = sources.project(share)
    return KeptImageMap(layout, kept, merged)


def kept_per_image(cache: TrackedCache | None, image_positions: np.ndarray | None, layout: ImageLayout | None,
                   policy: Policy, policy_state: PolicyState | None) -> list[float]:
    """Per image (or frame) of the prompt, the share of its image tokens the cache still holds, over every layer
    and KV head (a vision-side reduction's fed tokens count for the image they came from). [] without images."""
    if cache is None or image_positions is None or not len(image_positions) or layout is None:
        return []
    ranges = layout.image_ranges()
    original = np.array([stop - start for start, stop in ranges], dtype=np.float64)
    sources = policy.image_token_sources(policy_state)
    fed = torch.as_tensor(fed_image_positions(image_positions, sources))
    if sources is None:
        image_of = np.repeat(np.arange(len(ranges)), original.astype(np.int64))
    else:
        image_of = sources.images if getattr(sources, "images", None) is not None else np.zeros(sources.tokens, int)
    image_of = torch.as_tensor(image_of, dtype=torch.long)
    counts = torch.zeros(len(ranges), dtype=torch.float64)
    heads = 0
    for layer in cache.layers:
        pos = layer.positions[0].cpu().contiguous()  # [Hkv, T]
        heads = pos.shape[0]
        at = torch.searchsorted(fed.to(pos.dtype), pos).clamp(max=fed.numel() - 1)
        valid = (fed.to(pos.dtype)[at] == pos) & layer.is_image[0].cpu()
        counts += torch.bincount(image_of[at[valid]], minlength=len(ranges)).double()
    held = counts.numpy() / max(1, heads * len(cache.layers)) / np.maximum(original, 1)
    return [round(float(x), 4) for x in held]
