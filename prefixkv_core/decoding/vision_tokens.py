"""Vision-side token reduction: the image features a policy shrinks before the language model sees them (VisionZip,
Downsample).

It reads the vision tower's feature layer as `vision_tower.vision_features` records it (its hidden states, and its
attention probabilities and keys averaged over heads), from the comparison's one pass (`vision_tower.TurnImage`)
or from a pass of its own. The policy turns those into a plan (per crop, each output token a weighted sum of the
crop's feature-layer tokens, or of their projections); here the plan is applied and the model's projector maps the
result (or the projector's outputs are combined), and the prompt's image block is replaced by it, fed as input
embeddings: the language model sees fewer image tokens from the start, at contiguous positions.

Output order, as in the reference: a view of one crop (LLaVA-1.5, Interleave, an anyres base view) gives its
tokens in the plan's order (the CLS token, the dominant patches in raster order, the contextual tokens); a view
of several crops (the anyres tiles) gives the dominant patches of all its crops in raster order over the whole
tile grid, then the crops' CLS tokens, then their contextual tokens; pooled tokens are placed as dominant ones, by
the first patch they cover. Newline tokens are not fed: the reduced tokens no longer form rows.

Qwen's towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) are reduced per merged token by `qwen_vision`, whose fed tokens keep
the unreduced prompt's 3-D positions instead of contiguous ones.
InternVL's tower (its projector reads the patches pixel-shuffled, 2x2 to one token) is reduced per image token by
`internvl_vision`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.layout import CropPatches, crop_patches
from ..policies.base import Policy
from ..policies.reduction import KEPT_AS_IS, KINDS, ImageTokenSources, VisionCrops, VisionPlan, join_records
from .vision_tower import TurnImage, vision_features


@dataclass
class ReducedPrompt:
    ids: torch.Tensor  # [B, N'] the prompt with the shorter image block
    is_image: torch.Tensor  # [B, N']
    inputs_embeds: torch.Tensor | None  # [B, N', H]: text embeddings, the reduced image features in the image block
    record: ImageTokenSources  # of the first row (every row of a batch has the same layout)
    # Qwen (`qwen_vision`): the fed tokens' 3-D positions [3, B, N'] and rope deltas [B] from the unreduced prompt's
    # rope index; Qwen3-VL: the reduced features as the model's forward reads them (`mm_encoder_outputs`, DeepStack
    # features included) instead of input embeddings
    positions: torch.Tensor | None = None
    rope_deltas: torch.Tensor | None = None
    encoder_outputs: dict | None = None


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
                if kind in (*KEPT_AS_IS, "pooled"):
                    patch = int(plan.crops[c].sources(k)[0]) - int(has_cls)
                    dominant.append((int(raster[c][patch]), c, k))
        order += [(c, k) for _, c, k in sorted(dominant)]
        for kind in ("cls", "contextual"):
            order += [(c, k) for c in crops for k, kd in enumerate(plan.crops[c].kinds) if kd == kind]
    return order


def has_vision_plan(policy: Policy) -> bool:
    """Whether `policy` may shrink the image in the vision tower (it has a `vision_plan` of its own)."""
    return getattr(policy.vision_plan, "__func__", None) is not Policy.vision_plan


def _crops_per_image(config, sizes, per_row: int, n_images: int) -> list[int]:
    """How many of a row's crops each of its images has (one each, or an anyres image's base view and tiles)."""
    if n_images == 1:
        return [per_row]
    if sizes is None or getattr(config, "model_type", "llava") not in ("llava_next", "llava_onevision"):
        counts = [per_row // n_images] * n_images
    else:
        counts = [len(crop_patches(config, int(w), int(h)).tokens) for h, w in sizes[:n_images]]
    if sum(counts) != per_row:
        raise ValueError(f"cannot tell the {n_images} images' crops apart ({per_row} crops)")
    return counts


@dataclass
class _Segment:
    """One image, or a natively read video, of a prompt row: its tokens, the crops of it the tower encoded (a
    video: its frames), where their patches land among its tokens, and how many images (frames) it counts for."""

    tokens: int
    crops: slice
    patches: CropPatches | None
    pictures: int = 1
    video: bool = False


def _video_patches(config, frames: int) -> CropPatches:
    """Per frame, the video token each tower patch feeds after OneVision's pooling (the pooled cell it falls in)."""
    from ..models.video import pooled_side

    vc = config.vision_config
    side = int(vc.image_size) // int(vc.patch_size)
    pooled = pooled_side(config)
    flat = np.arange(side * side)
    r, c = np.divmod(flat, side)
    cell = (r * pooled // side) * pooled + (c * pooled // side)
    return CropPatches(tuple(k * pooled * pooled + cell for k in range(frames)), (flat,) * frames,
                       tuple(range(frames)))


def _segments(config, ids: torch.Tensor, found, sizes, rows: int, image_id: int, video_id: int | None
              ) -> list[_Segment]:
    """The images and the video of row 0 in prompt order (every row holds the same)."""
    per_image = list(found.per_image)
    n_images = len(per_image) // rows if per_image and len(per_image) % rows == 0 else len(per_image)
    per_image = per_image[:n_images]
    image_crops = (found.hidden.shape[0] - found.video_frames * rows) // rows
    counts = _crops_per_image(config, sizes, image_crops, n_images) if n_images else []
    segments, crop_at = [], 0
    vc = config.vision_config
    for i, (n_tok, n_crops) in enumerate(zip(per_image, counts)):
        height, width = (int(x) for x in sizes[i]) if sizes is not None else (vc.image_size, vc.image_size)
        patches = crop_patches(config, width, height)
        segments.append(_Segment(n_tok, slice(crop_at, crop_at + n_crops),
                                 patches if len(patches.tokens) == n_crops else None))
        crop_at += n_crops
    if found.video_frames:
        frames = found.video_frames // rows
        video = _Segment(found.video.shape[0] // rows, slice(crop_at, crop_at + frames), _video_patches(config, frames),
                         frames, True)
        first = int((ids[0] == video_id).nonzero()[0])
        images_before = int((ids[0, :first] == image_id).sum())  # the images whose tokens come before the video's
        at, k = 0, 0
        while k < len(segments) and at + segments[k].tokens <= images_before:
            at += segments[k].tokens
            k += 1
        segments.insert(k, video)
    return segments


@torch.inference_mode()
def reduce_image(model, policy: Policy, ids: torch.Tensor, is_image: torch.Tensor, vision_inputs,
                 image_token_id: int, turn_image: TurnImage | None = None) -> ReducedPrompt | None:
    """The prompt as the language model sees it after `policy`'s vision plan, or None when the policy has none for
    these images (it then sees them as the model's own path encodes them). Several images are each reduced on
    their own, and so is every frame of a natively read video (OneVision's: the plan then replaces the frame's
    pooling, its newline token stays), each keeping its part of the budget in proportion to its tokens; the text
    between them stays. `turn_image`: the turn's images already through the tower (its recorded pass and the
    prompt's embeddings are read from it), else a pass of its own. Every row holds the same images."""
    if not has_vision_plan(policy):
        return None
    if isinstance(vision_inputs, torch.Tensor):
        vision_inputs = {"pixel_values": vision_inputs}
    config = model.config
    found = turn_image.recorded() if turn_image is not None else vision_features(model, dict(vision_inputs))
    if found.qwen is not None:  # Qwen's towers: per merged token, 3-D positions kept (`qwen_vision`)
        from .qwen_vision import reduce_qwen

        got = reduce_qwen(model, policy, ids, is_image, dict(vision_inputs), found.qwen)
        if got is None:
            return None
        return ReducedPrompt(got.ids, got.is_image, got.inputs_embeds, got.record, got.positions, got.rope_deltas,
                             got.encoder_outputs)
    if found.internvl is not None:  # InternVL's tower: per pixel-shuffled image token (`internvl_vision`)
        from .internvl_vision import reduce_internvl

        got = reduce_internvl(model, policy, ids, is_image, found.internvl)
        return None if got is None else ReducedPrompt(got.ids, got.is_image, got.inputs_embeds, got.record)
    hidden, attention, keys = found.hidden, found.attention, found.keys
    # the text's embeddings: the shared prompt's rows outside the image blocks are exactly the ids' embeddings
    embedded = turn_image.prompt_embeds(ids, is_image) if turn_image is not None else None
    rows, n = ids.shape
    per_row = hidden.shape[0] // rows
    vc = config.vision_config
    side = int(vc.image_size) // int(vc.patch_size)
    has_cls = hidden.shape[1] == side * side + 1
    projector = model.model.multi_modal_projector
    embed = model.get_input_embeddings()
    video_id = getattr(config, "video_token_id", None) if found.video_frames else None
    segments = _segments(config, ids, found, vision_inputs.get("image_sizes"), rows, image_token_id, video_id)
    total = sum(seg.tokens for seg in segments)
    out_ids, out_flags, out_embeds, record = [], [], [], None
    for r in range(rows):
        flags = is_image[r]
        where = flags.nonzero().flatten()
        if where.numel() != total:
            raise ValueError(f"image features and image tokens do not match: {total} features, "
                             f"{where.numel()} tokens")
        text = embedded[r] if embedded is not None else embed(ids[r:r + 1])[0]
        pieces_ids, pieces_flags, pieces_embeds, records = [], [], [], []
        at, token_at = 0, 0
        for seg in segments:
            start, stop = int(where[token_at]), int(where[token_at + seg.tokens - 1]) + 1
            if stop - start != seg.tokens:
                raise ValueError("a vision-side reduction needs each image's tokens as one block")
            n_crops = seg.crops.stop - seg.crops.start
            crops = slice(r * per_row + seg.crops.start, r * per_row + seg.crops.stop)
            plan = policy.vision_plan(VisionCrops(attention[crops], keys[crops], has_cls, n, seg.tokens,
                                                  total if len(segments) > 1 else None))
            if plan is None:
                return None
            patches = seg.patches
            views = patches.views if patches is not None else (0,) * n_crops
            raster = patches.raster if patches is not None else tuple(np.arange(side * side) for _ in range(n_crops))
            order = _order(plan, views, raster, has_cls)
            feats = (projector(hidden[crops]) if plan.projected else hidden[crops]).float()
            merged = [plan.crops[c].weights.to(feats.device) @ feats[c] for c in range(n_crops)]
            image = torch.stack([merged[c][k] for c, k in order])
            image = image if plan.projected else projector(image.to(hidden.dtype)[None])[0]
            token = image_token_id
            if seg.video:  # the video's newline token (its last feature) closes it, as on the model's own path
                image = torch.cat([image, found.video[(r + 1) * seg.tokens - 1:(r + 1) * seg.tokens].float()])
                token = video_id
            pieces_embeds += [text[at:start], image.to(text.dtype)]
            pieces_ids += [ids[r, at:start], ids.new_full((image.shape[0],), token)]
            pieces_flags += [flags[at:start], flags.new_ones(image.shape[0])]
            if r == 0:
                records.append((_record(plan, order, patches, has_cls, seg.tokens, n_crops, seg.video), seg.pictures))
            at, token_at = stop, token_at + seg.tokens
        out_embeds.append(torch.cat(pieces_embeds + [text[at:]]))
        out_ids.append(torch.cat(pieces_ids + [ids[r, at:]]))
        out_flags.append(torch.cat(pieces_flags + [flags[at:]]))
        if r == 0:
            record = join_records(records, out_flags[0].nonzero().flatten().cpu().numpy())
    return ReducedPrompt(torch.stack(out_ids), torch.stack(out_flags), torch.stack(out_embeds), record)


def _record(plan: VisionPlan, order, patches, has_cls: bool, original: int, crops: int,
            video: bool = False) -> ImageTokenSources:
    """What each LM token of one image (a video: of its frames, then its newline token) stands for; `images`: the
    frame each came from (0 for an image)."""
    kinds, cells, images = [], [], []
    for c, k in order:
        kind = plan.crops[c].kinds[k]
        kinds.append(kind)
        images.append(c if video else 0)
        if kind == "cls" or patches is None:
            cells.append(np.zeros(0, dtype=np.int64))
            continue
        sources = plan.crops[c].sources(k) - int(has_cls)
        sources = sources[sources >= 0]
        tokens = patches.tokens[c][sources]
        cells.append(np.unique(tokens[tokens >= 0]))
    if video:  # the newline token: kept as it is, standing for itself
        kinds.append("dominant")
        cells.append(np.array([original - 1]))
        images.append(crops - 1)
    counts = {kind: kinds.count(kind) for kind in KINDS}
    return ImageTokenSources(kinds, cells, original, crops, counts, images=np.array(images, dtype=np.int64))
