"""Tokens leaving a forward after layer K (FastV's and DART's own prefill), for real: layers K and later compute
only the tokens kept, as those methods' papers do, instead of computing every token and masking the dropped ones
out of attention.

The text model's code is left as it is. Forward pre-hooks (a public PyTorch extension point) on its decoder layers from K
on cut what each layer is handed to the kept tokens: at layer K the hidden states, at every layer from K on the
rotary embeddings and position ids the model built for the whole prompt. The cache is told the kept tokens'
true positions and image flags before layer K writes, so each later layer holds the kept tokens' entries at
their own positions; the attention function's causal mask (bottom-right aligned) then orders the kept tokens
as before. A model that adds visual features to the hidden states after its first layers (Qwen3-VL's DeepStack)
has them cut in step: after layer K only the kept visual tokens get theirs. The statistics recorded from layer K on cover the kept tokens only, aligned with those layers'
entries. The last prompt token is always kept, so the logits are the same as a masked forward's.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..kv.attention import AttentionProbe
from ..kv.cache import TrackedCache
from ..policies.base import TokenDrop

_PER_TOKEN_KWARGS = ("position_ids", "cache_position")  # [B, N] or [N]: cut along the token axis


@contextlib.contextmanager
def tokens_dropped(model, drop: TokenDrop, cache: TrackedCache, probe: AttentionProbe) -> Iterator[None]:
    """While the block runs one forward of a prompt through `cache` (its pending positions and image flags
    [B, N] set), the text model's layers from `drop.layer` on see only the tokens `drop.choose(stats)` keeps
    (bool [B, N], the same count in every row), decided when layer K is reached from what `probe` recorded in
    layers 0 … K-1."""
    layers = model.get_decoder().layers
    index: torch.Tensor | None = None  # [B, kept]: the kept tokens of each row, once layer K has chosen
    handed: dict[str, object] = {}  # the whole-prompt inputs the model hands every layer, cut once at layer K

    def cut(x: torch.Tensor) -> torch.Tensor:
        """x [B or 1, N, ...] -> [B, kept, ...]."""
        if x.shape[0] == 1 and index.shape[0] > 1:
            x = x.expand(index.shape[0], *x.shape[1:])
        at = index.view(*index.shape, *[1] * (x.dim() - 2)).expand(*index.shape, *x.shape[2:])
        return x.gather(1, at)

    def cut_flat(x: torch.Tensor) -> torch.Tensor:
        """x [N] (one position per token, every row alike) -> [kept]."""
        if index.shape[0] > 1 and bool((index != index[0]).any()):
            raise ValueError("a per-token input shared by every row cannot follow rows that keep different tokens")
        return x.index_select(0, index[0])

    def before_layer(module, args, kwargs):
        nonlocal index
        if index is None:  # layer K: the choice, once, from what layers 0 … K-1 recorded
            mask = drop.choose(probe.stats)
            counts = mask.sum(dim=1)
            if bool((counts != counts[0]).any()):
                raise ValueError("a token drop must keep the same number of tokens in every row")
            index = torch.stack([row.nonzero().flatten() for row in mask])
            positions, is_image = cache.pending
            cache.set_pending(cut(positions), cut(is_image))
            if probe.after_image is not None:
                probe.after_image = cut(probe.after_image)
            if args:  # the later layers get layer K's output: the kept tokens already
                args = (cut(args[0]), *args[1:])
            else:
                kwargs["hidden_states"] = cut(kwargs["hidden_states"])
            rotary = kwargs.get("position_embeddings")
            if rotary is not None:
                handed["position_embeddings"] = tuple(cut(part) for part in rotary)
            for name in _PER_TOKEN_KWARGS:
                value = kwargs.get(name)
                if isinstance(value, torch.Tensor):
                    handed[name] = cut_flat(value) if value.dim() == 1 else cut(value)
        kwargs.update(handed)
        return args, kwargs

    handles = [layer.register_forward_pre_hook(before_layer, with_kwargs=True) for layer in layers[drop.layer:]]
    text = model.get_decoder()
    deepstack = getattr(text, "_deepstack_process", None)  # Qwen3-VL: visual features added after the first layers

    def deepstack_in_step(hidden_states, visual_pos_masks, visual_embeds):
        """After layer K the hidden states hold the kept tokens only: the visual positions and their features are
        cut with them (each visual token's feature row is its rank among the prompt's visual tokens)."""
        if index is None or visual_pos_masks.shape[1] == hidden_states.shape[1]:
            return deepstack(hidden_states, visual_pos_masks, visual_embeds)
        masks = visual_pos_masks.to(index.device)
        rank = masks.flatten().long().cumsum(0).view(masks.shape) - 1  # [B, N]: row-major, as the features
        kept_masks = cut(masks)
        return deepstack(hidden_states, kept_masks, visual_embeds[cut(rank)[kept_masks]])

    own = text.__dict__.get("_deepstack_process")  # an instance's own (else the class's method)
    if deepstack is not None:
        text._deepstack_process = deepstack_in_step
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if deepstack is not None:
            if own is None:
                del text._deepstack_process  # the class's own again
            else:
                text._deepstack_process = own
