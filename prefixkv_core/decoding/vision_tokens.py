"""Vision-side token reduction: the image features a policy shrinks before the language model sees them (VisionZip,
Downsample).

It runs the model's own image path once (`get_image_features`, a public method of every LLaVA family) with one
public extension point: an attention function registered for the vision config (transformers'
`AttentionInterface`) that records the feature layer's attention probabilities and keys, averaged over heads,
while the tower's own implementation computes every output. The policy turns those into a plan (per crop, each
output token a weighted sum of the crop's feature-layer tokens, or of their projections); here the plan is applied
and the model's projector maps the result (or the projector's outputs are combined), and the prompt's image block
is replaced by it, fed as input embeddings: the language model sees fewer image tokens from the start, at
contiguous positions.

Output order, as in the reference: a view of one crop (LLaVA-1.5, Interleave, an anyres base view) gives its
tokens in the plan's order (the CLS token, the dominant patches in raster order, the contextual tokens); a view
of several crops (the anyres tiles) gives the dominant patches of all its crops in raster order over the whole
tile grid, then the crops' CLS tokens, then their contextual tokens; pooled tokens are placed as dominant ones, by
the first patch they cover. Newline tokens are not fed: the reduced tokens no longer form rows.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..models.layout import crop_patches
from ..policies.base import Policy
from ..policies.reduction import KINDS, ImageTokenSources, VisionCrops, VisionPlan

VISION_ATTN_NAME = "prefixkv_vision_probe"


@dataclass
class ReducedPrompt:
    ids: torch.Tensor  # [B, N'] the prompt with the shorter image block
    is_image: torch.Tensor  # [B, N']
    inputs_embeds: torch.Tensor  # [B, N', H]: text embeddings, the reduced image features in the image block
    record: ImageTokenSources  # of the first row (every row of a batch has the same layout)


def feature_layer(config) -> tuple[int, int]:
    """(index into the tower's hidden states, index of the encoder layer that produced them) of the single vision
    feature layer; ValueError for towers that concatenate several layers."""
    vfl = getattr(config, "vision_feature_layer", -1)
    if not isinstance(vfl, int):
        raise ValueError(f"a vision-side reduction needs one vision feature layer; this model concatenates {vfl}")
    n = int(config.vision_config.num_hidden_layers)
    hidden = vfl % (n + 1)  # hidden_states[0] is the embedding output, [i] the output of layer i - 1
    if hidden == 0:
        raise ValueError("the vision feature layer is the patch embedding: it has no attention to rank tokens by")
    return vfl, hidden - 1


def _probabilities(query, key, mask, scale) -> torch.Tensor:
    """Softmax attention probabilities in fp32 for one crop ([1, H, T, D] each) under the tower's mask."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if mask is not None:
        mask = mask[..., : key.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1)


class _FeatureLayerProbe:
    """The vision config's attention function during one capture: counts the calls (one per encoder layer) and,
    at the feature layer, records the attention probabilities and keys, averaged over heads, in fp32 (one crop
    at a time, so at most one crop's [heads, T, T] probabilities exist at once)."""

    def __init__(self, layer: int, implementation: str):
        self.layer, self.calls = layer, 0
        self.delegate = ALL_ATTENTION_FUNCTIONS.get(implementation) if implementation != "eager" else None
        self.attention: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        index, self.calls = self.calls, self.calls + 1
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        crops = range(query.shape[0])

        def mask(c):
            if attention_mask is None or attention_mask.shape[0] == 1:
                return attention_mask
            return attention_mask[c:c + 1]

        if index == self.layer:
            self.attention = torch.cat([_probabilities(query[c:c + 1], key[c:c + 1], mask(c), scale).mean(dim=1)
                                        for c in crops])  # [C, T, T]
            self.keys = key.float().mean(dim=1)  # [C, T, D]
        if self.delegate is not None:
            return self.delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        # eager towers: the same arithmetic as their own eager attention
        out = torch.cat([torch.matmul(_probabilities(query[c:c + 1], key[c:c + 1], mask(c), scale).to(value.dtype),
                                      value[c:c + 1]) for c in crops])
        return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _vision_attention(model, probe: _FeatureLayerProbe):
    cfg = model.config
    previous = {"text_config": cfg.get_text_config()._attn_implementation or "sdpa",
                "vision_config": cfg.vision_config._attn_implementation or "sdpa"}
    AttentionInterface.register(VISION_ATTN_NAME, probe)
    try:
        model.set_attn_implementation({"text_config": previous["text_config"], "vision_config": VISION_ATTN_NAME})
        yield probe
    finally:
        model.set_attn_implementation(previous)
        AttentionInterface._global_mapping.pop(VISION_ATTN_NAME, None)


@torch.inference_mode()
def vision_features(model, vision_inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's own image path once: (feature-layer hidden states [C, T, Hv], its attention averaged over heads
    [C, T, T], its keys averaged over heads [C, T, D]) for every crop the tower encoded, CLS included."""
    hidden_index, layer = feature_layer(model.config)
    implementation = model.config.vision_config._attn_implementation or "sdpa"
    probe = _FeatureLayerProbe(layer, implementation)
    with _vision_attention(model, probe):
        out = model.get_image_features(**vision_inputs, return_dict=True)
    if probe.attention is None or probe.calls != int(model.config.vision_config.num_hidden_layers):
        raise RuntimeError("the vision tower's attention was not recorded at its feature layer")
    return out.hidden_states[hidden_index], probe.attention, probe.keys


def _order(plan: VisionPlan, views: tuple[int, ...], raster: tuple[np.ndarray, ...], has_cls: bool
           ) -> list[tuple[int, int]]:
    """(crop, output) pairs in the order the language model sees them (see the module doc)."""
    order: list[tuple[int, int]] = []
    for view in dict.fromkeys(views):
        crops = [c for c, v in enumerate(views) if v == view]
        if len(crops) == 1:
            order += [(crops[0], k) for k in range(len(plan.crops[crops[0]].kinds))]
            continue
        dominant = []
        for c in crops:
            for k, kind in enumerate(plan.crops[c].kinds):
                if kind in ("dominant", "pooled"):
                    patch = int(plan.crops[c].sources(k)[0]) - int(has_cls)
                    dominant.append((int(raster[c][patch]), c, k))
        order += [(c, k) for _, c, k in sorted(dominant)]
        for kind in ("cls", "contextual"):
            order += [(c, k) for c in crops for k, kd in enumerate(plan.crops[c].kinds) if kd == kind]
    return order


@torch.inference_mode()
def reduce_image(model, policy: Policy, ids: torch.Tensor, is_image: torch.Tensor, vision_inputs,
                 image_token_id: int) -> ReducedPrompt | None:
    """The prompt as the language model sees it after `policy`'s vision plan, or None when the policy has none for
    this image (it then sees the image as the model's own path encodes it)."""
    if getattr(policy.vision_plan, "__func__", None) is Policy.vision_plan:  # no plan of its own
        return None
    if isinstance(vision_inputs, torch.Tensor):
        vision_inputs = {"pixel_values": vision_inputs}
    config = model.config
    hidden, attention, keys = vision_features(model, dict(vision_inputs))
    rows, n = ids.shape
    per_row = hidden.shape[0] // rows
    vc = config.vision_config
    side = int(vc.image_size) // int(vc.patch_size)
    has_cls = hidden.shape[1] == side * side + 1
    projector = model.model.multi_modal_projector
    embed = model.get_input_embeddings()
    out_ids, out_flags, out_embeds, record = [], [], [], None
    for r in range(rows):
        flags = is_image[r]
        where = flags.nonzero().flatten()
        start, stop = int(where[0]), int(where[-1]) + 1
        if stop - start != where.numel():
            raise ValueError("a vision-side reduction needs the image tokens as one block")
        crops = slice(r * per_row, (r + 1) * per_row)
        plan = policy.vision_plan(VisionCrops(attention[crops], keys[crops], has_cls, n, where.numel()))
        if plan is None:
            return None
        sizes = vision_inputs.get("image_sizes")
        height, width = (int(x) for x in sizes[r]) if sizes is not None else (vc.image_size, vc.image_size)
        patches = crop_patches(config, width, height)
        if len(patches.tokens) != per_row:  # a layout we cannot place: keep the order, no overlay cells
            patches = None
        views = patches.views if patches is not None else (0,) * per_row
        raster = patches.raster if patches is not None else tuple(np.arange(side * side) for _ in range(per_row))
        order = _order(plan, views, raster, has_cls)
        feats = (projector(hidden[crops]) if plan.projected else hidden[crops]).float()
        merged = [plan.crops[c].weights.to(feats.device) @ feats[c] for c in range(per_row)]
        image = torch.stack([merged[c][k] for c, k in order])
        image = image if plan.projected else projector(image.to(hidden.dtype)[None])[0]
        text = embed(ids[r:r + 1])[0]
        out_embeds.append(torch.cat([text[:start], image.to(text.dtype), text[stop:]]))
        out_ids.append(torch.cat([ids[r, :start], ids.new_full((len(order),), image_token_id), ids[r, stop:]]))
        out_flags.append(torch.cat([flags[:start], flags.new_ones(len(order)), flags[stop:]]))
        if r == 0:
            record = _record(plan, order, patches, has_cls, where.numel(), per_row)
    return ReducedPrompt(torch.stack(out_ids), torch.stack(out_flags), torch.stack(out_embeds), record)


def _record(plan: VisionPlan, order, patches, has_cls: bool, original: int, crops: int) -> ImageTokenSources:
    kinds, cells = [], []
    for c, k in order:
        kind = plan.crops[c].kinds[k]
        kinds.append(kind)
        if kind == "cls" or patches is None:
            cells.append(np.zeros(0, dtype=np.int64))
            continue
        sources = plan.crops[c].sources(k) - int(has_cls)
        sources = sources[sources >= 0]
        tokens = patches.tokens[c][sources]
        cells.append(np.unique(tokens[tokens >= 0]))
    counts = {kind: kinds.count(kind) for kind in KINDS}
    return ImageTokenSources(kinds, cells, original, crops, counts)
