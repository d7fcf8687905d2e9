"""Vision-side token reduction (VisionZip, Downsample's grid pooling) on InternVL's tower.

What differs from the LLaVA towers (`vision_tokens`):

- InternVL's projector reads the feature layer's patches pixel-shuffled: the CLS token is dropped, and every 2x2
  block of the tile's patch grid (downsample_ratio 0.5) is concatenated into one vector, which the projector maps
  to one image token. A tile's image tokens are its merged grid (16x16 of a 448 px tile's 32x32 patches),
  row-major. Which patches each image token packs (`shuffle_groups`) is read by running the model's own
  `pixel_shuffle` over the patches' indices;
- each tile (every tile of the grid, then the thumbnail) is a crop the tower encodes on its own, and one view of
  the overlay's layout;
- the crop's tokens a plan weighs are the image tokens (the pixel-shuffled groups), so the feature layer's
  attention and keys are pooled over each group: the CLS token's attention to a group is the mean of its
  attention to the group's patches (averaged over heads), which ranks VisionZip's dominant tokens; a group's key
  is the mean of its patches' keys (for the contextual merge); the patch-to-patch attention is pooled over the
  groups of both the queries and the keys.

The feature layer is recorded as on the LLaVA towers (`vision_tower`: an attention function registered for the
vision config at the layer `vision_feature_layer` names), and the projector's input through a forward pre-hook on
the projector (a public PyTorch extension point), while the model's own path computes every output.

A plan's weights apply before the projector (VisionZip's merge and Downsample's `projector_in`: weighted sums of
the pixel-shuffled vectors, which the projector then maps, as LLaVA's projector maps merged feature-layer tokens)
or to the projector's outputs (Downsample's `projector_out`). Each tile gives its tokens in the plan's order (the
dominant tokens in raster order, then the contextual ones; pooled tokens row-major), the tiles in the tower's
order; the language model reads them at contiguous positions (InternVL's positions are 1-D).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from ..models.layout import image_runs
from ..policies.base import Policy
from ..policies.reduction import KINDS, ImageTokenSources, VisionCrops, join_records


def shuffle_groups(model, side: int) -> torch.Tensor:
    """[T', g]: the patches (raster index over a tile's side x side grid, CLS excluded) each image token packs, in
    the order the pixel shuffle concatenates them, read by running the model's own `pixel_shuffle` over the
    patches' indices."""
    index = torch.arange(side * side, dtype=torch.float64).reshape(1, side, side, 1)
    packed = model.model.pixel_shuffle(index, scale_factor=float(model.config.downsample_ratio))
    return packed.reshape(-1, packed.shape[-1]).round().long()


@contextlib.contextmanager
def projector_input(model):
    """Records what the projector reads (the pixel-shuffled feature layer, [C, T', g·Hv]) while installed:
    yields a dict whose "shuffled" entry holds it after the pass."""
    found: dict[str, torch.Tensor] = {}

    def before(module, args):
        found["shuffled"] = args[0]

    handle = model.model.multi_modal_projector.register_forward_pre_hook(before)
    try:
        yield found
    finally:
        handle.remove()


@dataclass
class InternVLTower:
    """One recorded pass of InternVL's tower over a prompt's images: per tile (every image's tiles, then thumbnail,
    images in order) the model's own features and the feature layer pooled over each pixel-shuffle group."""

    image: torch.Tensor  # [C·T', H]: the model's own image features, tiles in the tower's order
    shuffled: torch.Tensor  # [C, T', g·Hv]: what the projector reads
    attention: torch.Tensor  # [C, T', T'] fp32: patch-to-patch attention averaged over heads, pooled over groups
    keys: torch.Tensor  # [C, T', D] fp32: the group's patches' keys averaged over heads, then over the group
    cls: torch.Tensor | None  # [C, T'] fp32: the CLS token's attention to each group (None: the tower has none)

    @property
    def tokens_per_tile(self) -> int:
        return int(self.shuffled.shape[1])

    def nbytes(self) -> int:
        parts = (self.image, self.shuffled, self.attention, self.keys, self.cls)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def pooled_tower(model, image: torch.Tensor, shuffled: torch.Tensor, attention: torch.Tensor,
                 keys: torch.Tensor) -> InternVLTower:
    """The recorded feature layer (attention [C, T, T] and keys [C, T, D] over a tile's tokens, CLS first where
    the tower has one) pooled over each pixel-shuffle group."""
    vc = model.config.vision_config
    size = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
    patch = vc.patch_size[0] if isinstance(vc.patch_size, (list, tuple)) else vc.patch_size
    side = int(size) // int(patch)
    first = attention.shape[-1] - side * side
    if first not in (0, 1):
        raise ValueError(f"InternVL's tower gave {attention.shape[-1]} tokens a tile for a {side}x{side} patch grid")
    groups = shuffle_groups(model, side).to(attention.device)
    patches = attention[:, first:, first:]
    pooled = patches[:, groups][:, :, :, groups].mean(dim=(2, 4))  # [C, T', T']
    cls = attention[:, 0, first:][:, groups].mean(dim=-1) if first else None
    return InternVLTower(image, shuffled, pooled.float(), keys[:, first:][:, groups].mean(dim=2).float(),
                         None if cls is None else cls.float())


@dataclass
class InternVLReduced:
    """The prompt as the language model sees it after a vision plan on InternVL."""

    ids: torch.Tensor  # [B, N']
    is_image: torch.Tensor  # [B, N']
    inputs_embeds: torch.Tensor  # [B, N', H]
    record: ImageTokenSources


@torch.inference_mode()
def reduce_internvl(model, policy: Policy, ids: torch.Tensor, is_image: torch.Tensor,
                    tower: InternVLTower) -> InternVLReduced | None:
    """The prompt after `policy`'s vision plan over the recorded pass `tower`, None when the policy reduces nothing
    (the model's own path then reads the images). Each image's tiles are its crops, the image keeping its part of
    the budget in proportion to its tokens; every row holds the same images."""
    t = tower.tokens_per_tile
    rows, n = ids.shape
    images = image_runs(is_image[0])
    total = sum(tokens for _, tokens in images)
    if any(tokens % t for _, tokens in images):
        raise ValueError(f"an InternVL image block is not a whole number of {t}-token tiles")
    tiles_per_row = total // t
    if tower.shuffled.shape[0] not in (tiles_per_row, rows * tiles_per_row):
        raise ValueError(f"{tower.shuffled.shape[0]} tiles encoded for rows of {tiles_per_row} tiles")
    projector = model.model.multi_modal_projector
    embed = model.get_input_embeddings()
    out_ids, out_flags, out_embeds, record = [], [], [], None
    for r in range(rows):
        if image_runs(is_image[r]) != images:
            raise ValueError("a vision-side reduction needs every row to hold the same images")
        base = r * tiles_per_row if tower.shuffled.shape[0] > tiles_per_row else 0
        text = embed(ids[r:r + 1])[0]
        pieces_ids, pieces_flags, pieces_embeds, records = [], [], [], []
        at, tile_at = 0, base
        for start, tokens in images:
            tiles = slice(tile_at, tile_at + tokens // t)
            crops = VisionCrops(tower.attention[tiles], tower.keys[tiles], False, n, tokens,
                                total if len(images) > 1 else None,
                                cls_attention=tower.cls[tiles] if tower.cls is not None else None)
            plan = policy.vision_plan(crops)
            if plan is None:
                return None
            fed, kinds, cells = [], [], []
            for c, merge in enumerate(plan.crops):
                tile = tiles.start + c
                weights = merge.weights.to(tower.shuffled.device)
                if plan.projected:
                    fed.append(weights @ tower.image[tile * t:(tile + 1) * t].float())
                else:
                    mixed = (weights @ tower.shuffled[tile].float()).to(tower.shuffled.dtype)
                    fed.append(projector(mixed[None])[0].float())
                if r == 0:
                    kinds += merge.kinds
                    cells += [c * t + merge.sources(k) for k in range(len(merge.kinds))]
            image = torch.cat(fed)
            pieces_embeds += [text[at:start], image.to(text.dtype)]
            pieces_ids += [ids[r, at:start], ids.new_full((image.shape[0],), int(model.config.image_token_id))]
            pieces_flags += [is_image[r, at:start], is_image.new_ones(image.shape[0])]
            if r == 0:
                counts = {kind: kinds.count(kind) for kind in KINDS}
                records.append((ImageTokenSources(kinds, cells, tokens, tokens // t, counts,
                                                  images=np.zeros(len(kinds), dtype=np.int64)), 1))
            at, tile_at = start + tokens, tiles.stop
        out_embeds.append(torch.cat(pieces_embeds + [text[at:]]))
        out_ids.append(torch.cat(pieces_ids + [ids[r, at:]]))
        out_flags.append(torch.cat(pieces_flags + [is_image[r, at:]]))
        if r == 0:
            record = join_records(records, out_flags[0].nonzero().flatten().cpu().numpy())
    return InternVLReduced(torch.stack(out_ids), torch.stack(out_flags), torch.stack(out_embeds), record)
