"""Vision-side token reduction (VisionZip) on Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision towers.

What differs from the LLaVA towers (`vision_tokens`):

- the tower reads an image's patches in merge-group order (the four patches of every 2x2 merge group one after
  the other) and its merger maps each group to one language-model token; an image's tokens are its merged grid
  (h/2 x w/2 of its patch grid) row-major, and a video's are one merged grid per two-frame temporal group. The
  tower attends within each image (each temporal group of a video) on its own, so each of those is a crop here;
- there is no CLS token and no single feature layer: the scores come from one full-attention block
  (`score_block`): the last block of the tower (Qwen2-VL and Qwen3-VL attend over the whole image in every block,
  and the merger reads the last one's output, which is the layer VisionZip ranks by on LLaVA too: the one the
  projector reads), or on Qwen2.5-VL the last of its `fullatt_block_indexes` (the other blocks attend within
  windows). Qwen2.5-VL permutes the patches into windows before its blocks (`window_index`); the block's inputs
  are put back in the image's order before anything is computed;
- a token's score is the attention it receives (averaged over the crop's queries and the block's heads), pooled
  over its merge group (the mean of its four patches'): one score per language-model token. Its key, for the
  contextual merge, is the mean of its four patches' keys (averaged over heads).

The block is read through a forward pre-hook on its attention module (a public PyTorch extension point): the hook
takes the inputs the block hands its attention (hidden states, the rotary embeddings, the crops' boundaries) and
recomputes the probabilities in fp32, one head and one block of queries at a time (only the merge-pooled matrix is
kept), while the tower's own attention implementation computes every output, so the features are exactly a plain
pass's.

The plan (`VisionZipPolicy.vision_plan` over `VisionCrops` of merged tokens) then weighs the merger's outputs, the
embeddings the language model reads: a dominant token is fed as it is, a contextual token as the weighted mean of
the tokens it absorbs (VisionZip's anchor plus the mean of the tokens merged into it, halved to stay on the
embeddings' scale). Qwen3-VL's DeepStack features (added to the first text layers' hidden states at the visual
positions) are weighed by the same plan, so every fed visual token gets its own features and the dropped ones
none, in step.

Positions. The prompt's 3-D positions are the model's own rope index over the unreduced prompt; the reduced prompt
keeps them: the text (before, between and after the images) keeps its positions, a dominant token the (t, h, w) of
its cell, a contextual token that of its anchor (the cell it was merged onto). The rope delta grows by the tokens
removed, so everything after the prompt runs at the positions it has after the unreduced prompt, as after FastV's
drop.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import numpy as np
import torch

from ..policies.base import Policy
from ..policies.reduction import KINDS, ImageTokenSources, VisionCrops, join_records


_QUERY_BLOCK = 1024  # queries whose probabilities are computed at once


def score_block(config) -> int:
    """The vision block whose attention ranks the tokens: the last full-attention block (Qwen2.5-VL: the last of
    `fullatt_block_indexes`; Qwen2-VL and Qwen3-VL: the last block, every block attending over the whole image)."""
    vc = config.vision_config
    full = getattr(vc, "fullatt_block_indexes", None)
    if full:
        return int(max(full))
    return int(vc.depth) - 1


def _merge(config) -> int:
    return int(config.vision_config.spatial_merge_size)


def _window_order(visual, grid: torch.Tensor) -> torch.Tensor | None:
    """[patches]: which patch of the images' own order the tower's i-th patch is (Qwen2.5-VL's window
    permutation, at the patch level), None for a tower that keeps the order."""
    if not hasattr(visual, "fullatt_block_indexes"):
        return None
    from transformers.vision_utils import get_vision_window_index

    window_index, _ = get_vision_window_index(grid, spatial_merge_size=visual.spatial_merge_size,
                                              window_size=visual.window_size, patch_size=visual.patch_size)
    unit = visual.spatial_merge_unit
    window_index = window_index.to(grid.device)
    return (window_index[:, None] * unit + torch.arange(unit, device=grid.device)).flatten()


def _crop_bounds(grid: torch.Tensor) -> list[int]:
    """The patch boundaries of the crops (each image, each temporal group of a video) in the images' order."""
    sizes = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).tolist()
    return [0] + np.cumsum(sizes).tolist()


class _BlockRecorder:
    """While installed, records per crop of every tower pass: the merge-pooled attention [T', T'] (query, key;
    averaged over heads) of the scoring block and the merge-pooled keys [T', D], in fp32 (T' merged tokens)."""

    def __init__(self, model):
        self.visual = model.model.visual
        self.block = score_block(model.config)
        self.unit = _merge(model.config) ** 2
        self.grid: torch.Tensor | None = None
        self.attention: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []
        self.calls = 0

    def before_tower(self, module, args, kwargs):
        self.grid = kwargs.get("grid_thw") if "grid_thw" in kwargs else args[1]

    def before_attention(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        self.calls += 1
        order = _window_order(self.visual, self.grid)
        if order is not None:  # back to the images' own order (the inverse of the window permutation)
            back = torch.argsort(order)
            hidden, cos, sin = hidden[back], cos[back], sin[back]
        rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb_vision
        n = hidden.shape[0]
        q, k, _ = module.qkv(hidden).reshape(n, 3, module.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = rotate(q, k, cos, sin)
        q, k = q.float(), k.float()  # [n, heads, d]
        scale = float(module.scaling)
        bounds = _crop_bounds(self.grid)
        heads, unit = q.shape[1], self.unit
        for a, b in zip(bounds[:-1], bounds[1:]):
            t = (b - a) // unit
            # merge-pooled: entry (i, j) the mean over group i's queries and group j's keys (and the heads), so its
            # column means are the mean attention group j's patches receive. Made a block of queries at a time, so
            # at most a block's [rows, T] probabilities exist besides the pooled [T', T']
            pooled = torch.zeros(t, t, dtype=torch.float32, device=q.device)
            step = max(unit, _QUERY_BLOCK // unit * unit)
            for s in range(a, b, step):
                e = min(b, s + step)
                block = torch.zeros(e - s, b - a, dtype=torch.float32, device=q.device)
                for h in range(heads):
                    block += torch.softmax(q[s:e, h] @ k[a:b, h].T * scale, dim=-1)
                rows = (e - s) // unit
                pooled[(s - a) // unit:(s - a) // unit + rows] = \
                    block.reshape(rows, unit, t, unit).mean(dim=(1, 3)) / heads
            self.attention.append(pooled.cpu())
            self.keys.append(k[a:b].mean(dim=1).reshape(t, unit, -1).mean(dim=1).cpu())

    @contextlib.contextmanager
    def installed(self):
        handles = [self.visual.register_forward_pre_hook(self.before_tower, with_kwargs=True),
                   self.visual.blocks[self.block].attn.register_forward_pre_hook(self.before_attention,
                                                                                  with_kwargs=True)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


@dataclass
class QwenTower:
    """One recorded pass of a Qwen tower over a prompt's images (then its video): the model's own features, and per
    crop (each image, each temporal group of the video, in that order) the scoring block's merge-pooled attention
    and keys."""

    image: torch.Tensor | None  # [image tokens, H]: every image's merged features, in order
    video: torch.Tensor | None  # [video tokens, H]
    attention: list[torch.Tensor]  # per crop [T', T'] fp32
    keys: list[torch.Tensor]  # per crop [T', D] fp32
    image_deepstack: list[torch.Tensor] | None = None  # Qwen3-VL: per DeepStack layer [image tokens, H]
    video_deepstack: list[torch.Tensor] | None = None

    def nbytes(self) -> int:
        parts = [self.image, self.video, *self.attention, *self.keys, *(self.image_deepstack or []),
                 *(self.video_deepstack or [])]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _joined(out) -> torch.Tensor:
    pooled = out.pooler_output
    return torch.cat(list(pooled)) if isinstance(pooled, (tuple, list)) else pooled


def _deepstack(out) -> list[torch.Tensor] | None:
    found = getattr(out, "deepstack_features", None)
    if not found:
        return None
    return [torch.cat(list(f)) if isinstance(f, (tuple, list)) else f for f in found]


@torch.inference_mode()
def tower_pass(model, vision_inputs: dict) -> QwenTower:
    """The model's own image path (`get_image_features`), then its video path (`get_video_features`), with the
    scoring block recorded."""
    recorder = _BlockRecorder(model)
    image = video = image_ds = video_ds = None
    with recorder.installed():
        if vision_inputs.get("pixel_values") is not None:
            out = model.get_image_features(pixel_values=vision_inputs["pixel_values"],
                                           image_grid_thw=vision_inputs["image_grid_thw"], return_dict=True)
            image, image_ds = _joined(out), _deepstack(out)
        if vision_inputs.get("pixel_values_videos") is not None:
            out = model.get_video_features(pixel_values_videos=vision_inputs["pixel_values_videos"],
                                           video_grid_thw=vision_inputs["video_grid_thw"], return_dict=True)
            video, video_ds = _joined(out), _deepstack(out)
    return QwenTower(image, video, recorder.attention, recorder.keys, image_ds, video_ds)


# -- the prompt's visual items -----------------------------------------------------------------------------------

@dataclass
class _Item:
    """One image or video of row 0 in prompt order: where its tokens start, how many, its crops (indices into the
    pass's crops) and its features' rows (into the pass's image or video features)."""

    start: int
    tokens: int
    crops: list[int]
    rows: slice
    video: bool


def _items(config, ids: torch.Tensor, vision_inputs: dict, rows: int) -> tuple[list[_Item], int, int]:
    """Row 0's images and videos in prompt order (every row holds the same), and how many of the pass's image and
    video grids one row takes (the grids of all rows come one row after the other). A video whose temporal groups
    stand apart in the prompt (Qwen3-VL: a timestamp before each) is one item per group."""
    merge = _merge(config)
    image_grid, video_grid = vision_inputs.get("image_grid_thw"), vision_inputs.get("video_grid_thw")
    image_id, video_id = int(config.image_token_id), getattr(config, "video_token_id", None)
    crops_of = lambda grid: [int(g[0]) for g in grid.tolist()] if grid is not None else []  # noqa: E731
    image_crops, video_crops = crops_of(image_grid), crops_of(video_grid)
    items, row = [], ids[0].tolist()
    k_img = k_vid = at_img = at_vid = 0
    crop_img, crop_vid = 0, sum(image_crops)  # the pass lists the images' crops, then the videos'
    p = 0
    while p < len(row):
        token = row[p]
        if token == image_id or (video_id is not None and token == int(video_id)):
            video = token != image_id
            grid = (video_grid if video else image_grid)[k_vid if video else k_img]
            n = int(grid.prod()) // (merge * merge)
            t = int(grid[0])
            if video and t > 1 and row[p:p + n] != [token] * n:  # one run per temporal group
                per_group = n // t
                for g in range(t):
                    while row[p] != token:
                        p += 1
                    items.append(_Item(p, per_group, [crop_vid + g], slice(at_vid, at_vid + per_group), True))
                    p, at_vid = p + per_group, at_vid + per_group
                k_vid, crop_vid = k_vid + 1, crop_vid + t
                continue
            if video:
                items.append(_Item(p, n, list(range(crop_vid, crop_vid + t)), slice(at_vid, at_vid + n), True))
                k_vid, at_vid, crop_vid = k_vid + 1, at_vid + n, crop_vid + t
            else:
                items.append(_Item(p, n, list(range(crop_img, crop_img + t)), slice(at_img, at_img + n), False))
                k_img, at_img, crop_img = k_img + 1, at_img + n, crop_img + t
            p += n
            continue
        p += 1
    if rows > 1 and len(image_crops) == rows * k_img and len(video_crops) == rows * k_vid:
        return items, k_img, k_vid
    return items, 0, 0  # one set of grids for every row


@dataclass
class QwenReduced:
    """The prompt as the language model sees it after a vision plan on Qwen."""

    ids: torch.Tensor  # [B, N']
    is_image: torch.Tensor  # [B, N']
    inputs_embeds: torch.Tensor | None  # [B, N', H] (Qwen2-VL, Qwen2.5-VL)
    encoder_outputs: dict | None  # Qwen3-VL: the reduced features and DeepStack features the model's forward reads
    positions: torch.Tensor  # [3, B, N']: each fed token's 3-D position from the unreduced prompt's rope index
    rope_deltas: torch.Tensor  # [B]
    record: ImageTokenSources


def _features_before(grids: torch.Tensor | None, per_row: int, r: int) -> int:
    """The patches of the pass that come before row r's grids (0 when every row reads the same grids)."""
    if grids is None or per_row == 0 or r == 0:
        return 0
    return int(grids[: r * per_row].prod(-1).sum())


@torch.inference_mode()
def reduce_qwen(model, policy: Policy, ids: torch.Tensor, is_image: torch.Tensor, vision_inputs: dict,
                tower: QwenTower) -> QwenReduced | None:
    """The prompt after `policy`'s vision plan over the recorded pass `tower`, None when the policy reduces
    nothing (the model's own path then reads the images). Each image and each temporal group of a video is a crop
    with its share of the budget (`VisionCrops`); every row holds the same images (one plan for all)."""
    from ..models.families import hooks_of

    config = model.config
    merge2 = _merge(config) ** 2
    rows, n = ids.shape
    items, imgs_per_row, vids_per_row = _items(config, ids, vision_inputs, rows)
    total = sum(item.tokens for item in items)
    image_grid, video_grid = vision_inputs.get("image_grid_thw"), vision_inputs.get("video_grid_thw")
    plans = []
    for item in items:
        crops = item.crops
        attention = torch.stack([tower.attention[c] for c in crops])
        keys = torch.stack([tower.keys[c] for c in crops])
        plan = policy.vision_plan(VisionCrops(attention, keys, False, n, item.tokens,
                                              total if len(items) > 1 else None, merged=True))
        if plan is None:
            return None
        if not plan.projected or any("pooled" in merge.kinds for merge in plan.crops):
            raise ValueError("grid pooling needs the LLaVA towers' square crops: not on Qwen-VL's merged grids "
                             "(Downsample resizes the image before the tower there, where = image)")
        plans.append(plan)
    positions, deltas = hooks_of(config).rope_index(model, ids, vision_inputs)
    embed = model.get_input_embeddings()
    deepstack = tower.image_deepstack is not None or tower.video_deepstack is not None
    out_ids, out_flags, out_embeds, out_pos, out_feats, out_ds, out_video = [], [], [], [], [], [], []
    record = None
    for r in range(rows):
        text = embed(ids[r:r + 1])[0]
        img_feat0 = _features_before(image_grid, imgs_per_row, r) // merge2
        vid_feat0 = _features_before(video_grid, vids_per_row, r) // merge2
        pieces_ids, pieces_flags, pieces_embeds, sources = [], [], [], []
        records, at = [], 0
        for item, plan in zip(items, plans):
            if not bool(is_image[r, item.start:item.start + item.tokens].all()):
                raise ValueError("a vision-side reduction needs every row to hold the same images")
            feats_all = tower.video if item.video else tower.image
            base = vid_feat0 if item.video else img_feat0
            rows_of = slice(item.rows.start + base, item.rows.stop + base)
            feats = feats_all[rows_of].float()
            ds_all = tower.video_deepstack if item.video else tower.image_deepstack
            per_crop = item.tokens // len(item.crops)
            weights, anchors, kinds, images = [], [], [], []
            for c, merge in enumerate(plan.crops):
                w = torch.zeros(merge.weights.shape[0], item.tokens)
                w[:, c * per_crop:(c + 1) * per_crop] = merge.weights
                weights.append(w)
                anchors += [c * per_crop + merge.anchor(k) for k in range(len(merge.kinds))]
                kinds += merge.kinds
                images += [c if item.video else 0] * len(merge.kinds)
            weights = torch.cat(weights).to(feats.device)
            image = weights @ feats
            if deepstack:
                out_ds.append([weights @ d[rows_of].float() for d in ds_all])
            pieces_embeds += [text[at:item.start], image.to(text.dtype)]
            token = int(config.video_token_id) if item.video else int(config.image_token_id)
            pieces_ids += [ids[r, at:item.start], ids.new_full((image.shape[0],), token)]
            pieces_flags += [is_image[r, at:item.start], is_image.new_ones(image.shape[0])]
            sources += [torch.arange(at, item.start), item.start + torch.tensor(anchors, dtype=torch.long)]
            out_feats.append(image)
            out_video.append(item.video)
            if r == 0:
                cells = [np.unique(np.asarray(w.nonzero().flatten().cpu())) for w in weights]
                rec = ImageTokenSources(kinds, cells, item.tokens, len(item.crops),
                                        {kind: kinds.count(kind) for kind in KINDS},
                                        images=np.array(images, dtype=np.int64))
                records.append((rec, len(item.crops) if item.video else 1))
            at = item.start + item.tokens
        out_ids.append(torch.cat(pieces_ids + [ids[r, at:]]))
        out_flags.append(torch.cat(pieces_flags + [is_image[r, at:]]))
        out_embeds.append(torch.cat(pieces_embeds + [text[at:]]))
        src = torch.cat(sources + [torch.arange(at, n)]).to(positions.device)
        out_pos.append(positions[:, r, src])
        if r == 0:
            record = join_records(records, out_flags[0].nonzero().flatten().cpu().numpy())
    fed_ids, fed_flags = torch.stack(out_ids), torch.stack(out_flags)
    fed_positions = torch.stack(out_pos, dim=1)
    fed_deltas = deltas + (n - fed_ids.shape[1])
    if not deepstack:
        return QwenReduced(fed_ids, fed_flags, torch.stack(out_embeds), None, fed_positions, fed_deltas, record)
    return QwenReduced(fed_ids, fed_flags, None, _encoder_outputs(out_feats, out_ds, out_video),
                       fed_positions, fed_deltas, record)


def _encoder_outputs(feats: list[torch.Tensor], deepstack: list[list[torch.Tensor]], video: list[bool]) -> dict:
    """Qwen3-VL: the reduced features and their DeepStack features as the model's forward reads precomputed encoder
    outputs (`mm_encoder_outputs`): the images' fed tokens' features in prompt order, rows one after the other, and
    the video's apart (`video`: whether each piece is a video's), each kind scattered onto its own tokens and their
    DeepStack features joined at the visual positions by the model itself."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    layers = len(deepstack[0])
    out = {}
    for kind, wanted in (("image", False), ("video", True)):
        picked = [k for k, is_video in enumerate(video) if is_video == wanted]
        if picked:
            stacks = [tuple(deepstack[k][layer] for k in picked) for layer in range(layers)]
            out[kind] = BaseModelOutputWithDeepstackFeatures(pooler_output=tuple(feats[k] for k in picked),
                                                             deepstack_features=stacks)
    return out
