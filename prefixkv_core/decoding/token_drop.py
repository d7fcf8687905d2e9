"""Tokens leaving a forward after layer K (FastV's and DART's own prefill), or in several stages (PyramidDrop), for
real: layers K and later compute only the tokens kept, as those methods' papers do, instead of computing every
token and masking the dropped ones out of attention. At each later stage the tokens still in the forward are cut
again, the same way.

The text model's code is left as it is. Forward pre-hooks (a public PyTorch extension point) on its decoder layers from K
on cut what each layer is handed to the kept tokens: at layer K the hidden states, at every layer from K on the
rotary embeddings and position ids the model built for the whole prompt. The cache is told the kept tokens'
true positions and image flags before layer K writes, so each later layer holds the kept tokens' entries at
their own positions; the attention function's causal mask (bottom-right aligned) then orders the kept tokens
as before. A model that adds visual features to the hidden states after its first layers (Qwen3-VL's DeepStack)
has them cut in step: after each stage only the kept visual tokens get theirs. The statistics recorded from layer K on cover the kept tokens only, aligned with those layers'
entries (and the probe's raters are cut with them). The last prompt token is always kept, so the logits are the
same as a masked forward's.

A stage may also recycle tokens (SparseVLM, `Recycled`): some of the tokens it keeps are handed, instead of their
own hidden state, the mean of a group of the tokens before the stage (its own among them), at their own positions.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Sequence

import torch

from ..kv.attention import AttentionProbe
from ..kv.cache import TrackedCache
from ..policies.base import Recycled, TokenDrop

_PER_TOKEN_KWARGS = ("position_ids", "cache_position")  # [B, N] or [N]: cut along the token axis


def with_recycled(going_on: torch.Tensor, before: torch.Tensor, mask: torch.Tensor, recycled: Recycled) -> torch.Tensor:
    """going_on [B, kept, D] (the hidden states of the tokens `mask` [B, M] keeps, in order) with each of
    `recycled`'s slots handed the mean of its members' hidden states in `before` [B, M, D] (in fp32)."""
    members = recycled.members.to(before.device)
    if members.shape[1] == 0:
        return going_on
    means = (members.float() @ before.float()) / members.sum(dim=-1, keepdim=True).clamp(min=1).float()
    at = (mask.long().cumsum(dim=1) - 1).gather(1, recycled.slots.to(mask.device))  # each slot among the kept
    out = going_on.clone()
    out.scatter_(1, at.unsqueeze(-1).expand(*at.shape, out.shape[-1]), means.to(out.dtype))
    return out


@contextlib.contextmanager
def tokens_dropped(model, drops: Sequence[TokenDrop], cache: TrackedCache, probe: AttentionProbe) -> Iterator[None]:
    """While the block runs one forward of a prompt through `cache` (its pending positions and image flags
    [B, N] set), tokens leave the text model's forward in stages (`drops`, by ascending layer): when the forward
    reaches a stage's layer K, `choose(stats, kept)` decides from what `probe` recorded so far which of the tokens
    still in it go on (bool [B, kept], the same count in every row; with a `Recycled`, some of them carry merged
hidden states), and layers from K on see only those."""
    stages = {drop.layer: drop for drop in drops}
    if len(stages) != len(drops) or list(stages) != sorted(stages):
        raise ValueError("token drop stages must be at distinct, ascending layers")
    layers = model.get_decoder().layers
    index: torch.Tensor | None = None  # [B, kept]: each row's tokens still in the forward, as prompt positions
    whole: dict[str, object] = {}  # the whole-prompt inputs the model hands every layer, as the first stage got them
    handed: dict[str, object] = {}  # those inputs cut to the tokens still in the forward

    def cut(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """x [B or 1, M, ...] -> [B, kept, ...], the tokens `at` [B, kept] (indices along M)."""
        if x.shape[0] == 1 and at.shape[0] > 1:
            x = x.expand(at.shape[0], *x.shape[1:])
        return x.gather(1, at.view(*at.shape, *[1] * (x.dim() - 2)).expand(*at.shape, *x.shape[2:]))

    def cut_flat(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """x [N] (one position per token, every row alike) -> [kept]."""
        if at.shape[0] > 1 and bool((at != at[0]).any()):
            raise ValueError("a per-token input shared by every row cannot follow rows that keep different tokens")
        return x.index_select(0, at[0])

    def before_layer(module, args, kwargs, at_layer: int):
        nonlocal index
        drop = stages.get(at_layer)
        if drop is not None:  # a stage's layer: the choice, once, from what the layers before recorded
            if index is None:
                n = cache.pending[0].shape[1]
                index = torch.arange(n, device=cache.pending[0].device).expand(cache.pending[0].shape[0], n)
                rotary = kwargs.get("position_embeddings")
                if rotary is not None:
                    whole["position_embeddings"] = rotary
                whole.update({name: kwargs[name] for name in _PER_TOKEN_KWARGS
                              if isinstance(kwargs.get(name), torch.Tensor)})
            hidden = args[0] if args else kwargs["hidden_states"]
            answer = drop.choose(probe.stats, index, hidden) if drop.reads_hidden else drop.choose(probe.stats, index)
            mask, recycled = answer if isinstance(answer, tuple) else (answer, None)
            counts = mask.sum(dim=1)
            if bool((counts != counts[0]).any()):
                raise ValueError("a token drop must keep the same number of tokens in every row")
            sub = torch.stack([row.nonzero().flatten() for row in mask])  # among the tokens still in
            index = index.gather(1, sub)
            positions, is_image = cache.pending
            cache.set_pending(cut(positions, sub), cut(is_image, sub))
            for name in ("after_image", "raters"):
                flags = getattr(probe, name)
                if flags is not None:
                    setattr(probe, name, cut(flags, sub))
            going_on = cut(hidden, sub)  # this layer gets the layer before's output: the tokens still in
            if recycled is not None:
                going_on = with_recycled(going_on, hidden, mask, recycled)
            if args:
                args = (going_on, *args[1:])
            else:
                kwargs["hidden_states"] = going_on
            if "position_embeddings" in whole:
                handed["position_embeddings"] = tuple(cut(part, index) for part in whole["position_embeddings"])
            for name in _PER_TOKEN_KWARGS:
                value = whole.get(name)
                if value is not None:
                    handed[name] = cut_flat(value, index) if value.dim() == 1 else cut(value, index)
        kwargs.update(handed)
        return args, kwargs

    first = min(stages)
    handles = [layer.register_forward_pre_hook(functools.partial(before_layer, at_layer=first + i), with_kwargs=True)
               for i, layer in enumerate(layers[first:])]
    text = model.get_decoder()
    deepstack = getattr(text, "_deepstack_process", None)  # Qwen3-VL: visual features added after the first layers

    def deepstack_in_step(hidden_states, visual_pos_masks, visual_embeds):
        """After layer K the hidden states hold the kept tokens only: the visual positions and their features are
        cut with them (each visual token's feature row is its rank among the prompt's visual tokens)."""
        if index is None or visual_pos_masks.shape[1] == hidden_states.shape[1]:
            return deepstack(hidden_states, visual_pos_masks, visual_embeds)
        masks = visual_pos_masks.to(index.device)
        rank = masks.flatten().long().cumsum(0).view(masks.shape) - 1  # [B, N]: row-major, as the features
        kept_masks = cut(masks, index)
        return deepstack(hidden_states, kept_masks, visual_embeds[cut(rank, index)[kept_masks]])

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
