"""Where each image token of a LLaVA prompt comes from: the views of the image and their patch grids.

LLaVA-1.5 and LLaVA-Interleave see one view: a grid of patches over the image (CLIP centre-crops it to a
square, SigLIP squashes it). LLaVA-NeXT and LLaVA-OneVision ("anyres") see two: the whole image squashed to
the tower's square (the base view), then the image resized into the best grid of tiles, with the tiles'
padding cut away again and an image-newline token closing every row of that high-resolution grid (OneVision
also shrinks that grid when it holds more than about nine tiles' worth of patches). So the number of image
tokens depends on the image's size.

`image_layout` computes the token layout the way transformers packs the features (`pack_image_features`,
`unpad_image`, `select_best_resolution`); the tests check it against the processors' token counts. Plain
Python and numpy: the overlay reads it without torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

Box = tuple[float, float, float, float]  # (left, top, right, bottom) as fractions of the original image


@dataclass(frozen=True)
class GridView:
    """One view of the image: `rows` x `cols` patch tokens in row-major order over `box` of the original image,
    each row followed by one image-newline token when `newline`. `tile_rows` / `tile_cols`: where the crops
    the vision tower saw meet, as fractions of the box (for drawing the tiles)."""

    name: str
    rows: int
    cols: int
    box: Box = (0.0, 0.0, 1.0, 1.0)
    newline: bool = False
    tile_rows: tuple[float, ...] = ()
    tile_cols: tuple[float, ...] = ()
    image: int = 0  # which of the prompt's images (or a video's frames) the view belongs to, in prompt order

    @property
    def n_tokens(self) -> int:
        return self.rows * (self.cols + (1 if self.newline else 0))

    @property
    def n_patches(self) -> int:
        return self.rows * self.cols

    def describe(self) -> dict:
        return {"name": self.name, "image": self.image, "rows": self.rows, "cols": self.cols,
                "newline": self.newline, "tokens": self.n_tokens, "box": [round(v, 4) for v in self.box],
                "tiles": [len(self.tile_rows) + 1, len(self.tile_cols) + 1]}


@dataclass(frozen=True)
class ImageLayout:
    """The image tokens of a prompt: the views of its images in the order their tokens appear. One image for most
    prompts; several (`join_layouts`) when the prompt holds several images or a video's frames, each view then
    naming its image. Token indices count the prompt's image tokens only (the text between images is not in it)."""

    views: tuple[GridView, ...]
    image_size: tuple[int, int] = (0, 0)  # (width, height) of the (first) original image
    image_sizes: tuple[tuple[int, int], ...] = ()  # every image's (width, height), in prompt order; () = one image

    @property
    def n_tokens(self) -> int:
        return sum(v.n_tokens for v in self.views)

    @property
    def n_images(self) -> int:
        return max(1, len(self.image_sizes))

    def sizes(self) -> tuple[tuple[int, int], ...]:
        return self.image_sizes or (self.image_size,)

    def image_ranges(self) -> list[tuple[int, int]]:
        """Per image, [start, stop) of its tokens among the prompt's image tokens."""
        ranges, at = [], 0
        for i in range(self.n_images):
            n = sum(v.n_tokens for v in self.views if v.image == i)
            ranges.append((at, at + n))
            at += n
        return ranges

    def frame_tokens(self, is_frame: list[bool]) -> np.ndarray | None:
        """[F, P]: the patch tokens (newline tokens left out) of each image `is_frame` marks as a video frame, as
        indices among the prompt's image tokens in reading order, so that column j holds the same patch of every
        frame. None when fewer than two frames are marked or they do not hold the same number of patches."""
        views, _, cols = self.token_cells()
        picture = np.array([v.image for v in self.views], dtype=np.int64)[views]
        patch = cols < np.array([v.cols for v in self.views], dtype=np.int64)[views]
        frames = [np.nonzero((picture == i) & patch)[0] for i, marked in enumerate(is_frame) if marked]
        if len(frames) < 2 or len({f.size for f in frames}) != 1 or frames[0].size == 0:
            return None
        return np.stack(frames)

    def image_views(self, image: int) -> list[int]:
        """The indices of the views of one image."""
        return [k for k, v in enumerate(self.views) if v.image == image]

    def token_cells(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per image token (in prompt order): (view index, row, col); col == view.cols marks a newline token."""
        views, rows, cols = [], [], []
        for i, v in enumerate(self.views):
            width = v.cols + (1 if v.newline else 0)
            r, c = np.divmod(np.arange(v.n_tokens), width)
            views.append(np.full(v.n_tokens, i))
            rows.append(r)
            cols.append(c)
        if not views:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(views), np.concatenate(rows), np.concatenate(cols)

    def describe(self) -> list[dict]:
        return [v.describe() for v in self.views]


def strip_layout(n_tokens: int, image_size: tuple[int, int] = (0, 0)) -> ImageLayout:
    """A layout that places every token in one row over the whole image (when the real one is unknown)."""
    return ImageLayout((GridView("image tokens", 1, n_tokens),), image_size)


def join_layouts(layouts: list[ImageLayout]) -> ImageLayout:
    """The layout of several images (or videos' frames) in one prompt: each one's views in turn, tagged with its
    image's index among them all."""
    if len(layouts) == 1:
        return layouts[0]
    views, sizes = [], []
    for layout in layouts:  # a layout may hold several images already (a video's frames)
        views += [replace(v, image=len(sizes) + v.image) for v in layout.views]
        sizes += list(layout.sizes())
    return ImageLayout(tuple(views), layouts[0].image_size, tuple(sizes))


# -- the families' geometry --------------------------------------------------------------------------------------

def _centre_square(width: int, height: int) -> Box:
    """The centred square a CLIP-style processor crops after resizing the short side."""
    s = min(width, height)
    left, top = (width - s) / 2 / width, (height - s) / 2 / height
    return (left, top, 1.0 - left, 1.0 - top)


def _crops_to_square(image_processor) -> bool:
    """Resize the short side then centre crop (CLIP); otherwise the image is resized to the square (SigLIP)."""
    size = getattr(image_processor, "size", None) or {}
    get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
    return bool(getattr(image_processor, "do_center_crop", False)) and get("shortest_edge") is not None


def best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The pinpoint (h, w) that keeps the most of the image's pixels, then wastes the fewest (as transformers)."""
    from transformers.image_processing_utils import select_best_resolution

    return tuple(int(v) for v in select_best_resolution((height, width), [list(p) for p in pinpoints]))


def _tile_lines(n_tiles: int, side: int, pad: int, kept: int) -> tuple[float, ...]:
    """Where tiles meet in a grid of `kept` features after `pad` were cut from its start, as fractions of it."""
    return tuple((k * side - pad) / kept for k in range(1, n_tiles) if 0 < k * side - pad < kept)


@dataclass(frozen=True)
class AnyresGrid:
    """The high-resolution part of an anyres image: `tiles_h` x `tiles_w` crops of `side` x `side` patches (the full
    grid), of which rows [pad_top, pad_top + rows) and columns [pad_left, pad_left + cols) show the image (the rest
    is padding, cut away), then shrunk to `out_rows` x `out_cols` when over the tile limit (OneVision)."""

    side: int
    tiles_h: int
    tiles_w: int
    pad_top: int
    pad_left: int
    rows: int
    cols: int
    out_rows: int
    out_cols: int


def anyres_grid(width: int, height: int, *, side: int, tile_px: int, pinpoints, max_tiles: int | None) -> AnyresGrid:
    """The geometry of the tiles of an image of `width` x `height` pixels (the best pinpoint, unpadded, shrunk)."""
    best_h, best_w = best_resolution(height, width, pinpoints)
    tiles_h, tiles_w = best_h // tile_px, best_w // tile_px
    cur_h, cur_w = tiles_h * side, tiles_w * side
    pad_top = pad_left = 0
    if width / height > cur_w / cur_h:  # wider than the grid: padding above and below was cut
        new_h = int(round(height * (cur_w / width), 7))
        pad_top = (cur_h - new_h) // 2
        rows, cols = cur_h - 2 * pad_top, cur_w
    else:
        new_w = int(round(width * (cur_h / height), 7))
        pad_left = (cur_w - new_w) // 2
        rows, cols = cur_h, cur_w - 2 * pad_left
    out_rows, out_cols = rows, cols
    if max_tiles is not None:
        ratio = math.sqrt(rows * cols / (max_tiles * side * side))
        if ratio > 1.1:  # bilinear downsampling of the feature grid; the tiles keep their place in it
            out_rows, out_cols = int(rows // ratio), int(cols // ratio)
    return AnyresGrid(side, tiles_h, tiles_w, pad_top, pad_left, rows, cols, out_rows, out_cols)


def anyres_layout(width: int, height: int, *, side: int, tile_px: int, pinpoints, max_tiles: int | None,
                  base_tokens: int) -> ImageLayout:
    """LLaVA-NeXT / OneVision: the base view (`base_tokens` = side x side), then the high-resolution grid of the
    best pinpoint, unpadded, shrunk when over `max_tiles` tiles' worth (OneVision), a newline per row."""
    g = anyres_grid(width, height, side=side, tile_px=tile_px, pinpoints=pinpoints, max_tiles=max_tiles)
    tile_rows = _tile_lines(g.tiles_h, side, g.pad_top, g.rows)
    tile_cols = _tile_lines(g.tiles_w, side, g.pad_left, g.cols)
    base_side = int(round(math.sqrt(base_tokens)))
    base = GridView("base", base_side, base_side)
    tiles = GridView("tiles", g.out_rows, g.out_cols, newline=True, tile_rows=tile_rows, tile_cols=tile_cols)
    return ImageLayout((base, tiles), (width, height))


@dataclass(frozen=True)
class CropPatches:
    """Where the patches of every crop the vision tower encodes (in its order: the one view, or an anyres image's
    base view then its tiles row by row) land among the prompt's image tokens."""

    tokens: tuple[np.ndarray, ...]  # per crop [side*side]: the image token each patch becomes, -1 for none (padding)
    raster: tuple[np.ndarray, ...]  # per crop [side*side]: the patch's place in raster order over its view's grid
    views: tuple[int, ...]  # per crop: the index of its view in the layout


def _anyres_args(config) -> dict:
    vc = config.vision_config
    max_tiles = None
    if getattr(config, "model_type", "llava") == "llava_onevision":
        aspect = str(getattr(config, "vision_aspect_ratio", "anyres_max_9"))
        max_tiles = int(aspect.removeprefix("anyres_max_")) if aspect.startswith("anyres_max_") else None
    return dict(side=int(vc.image_size) // int(vc.patch_size), tile_px=int(vc.image_size),
                pinpoints=config.image_grid_pinpoints, max_tiles=max_tiles)


def _other_family(config):
    """The family module of a config that is not a LLaVA family's (None for the LLaVA families)."""
    if getattr(config, "model_type", "llava") in ("llava", "llava_next", "llava_onevision"):
        return None
    from .families import hooks_of

    return hooks_of(config)


def crop_patches(config, width: int, height: int) -> CropPatches:
    """The crops of one image of `width` x `height` pixels and, per patch, the prompt image token it feeds (its
    index in the image block of `image_layout`). Anyres tiles: the patch's cell in the unpadded (and, for
    OneVision, shrunk) grid; patches in the padding feed none. Another family: its module's."""
    if (other := _other_family(config)) is not None:
        return other.crop_patches(config, width, height)
    vc = config.vision_config
    side = int(vc.image_size) // int(vc.patch_size)
    flat = np.arange(side * side)
    if getattr(config, "model_type", "llava") not in ("llava_next", "llava_onevision"):
        return CropPatches((flat,), (flat,), (0,))
    g = anyres_grid(width, height, **_anyres_args(config))
    tokens, raster, views = [flat], [flat], [0]
    r, c = np.divmod(flat, side)
    for k in range(g.tiles_h * g.tiles_w):
        ti, tj = divmod(k, g.tiles_w)
        full_r, full_c = ti * side + r, tj * side + c
        ur, uc = full_r - g.pad_top, full_c - g.pad_left
        shown = (ur >= 0) & (ur < g.rows) & (uc >= 0) & (uc < g.cols)
        out_r = np.clip(ur * g.out_rows // max(g.rows, 1), 0, g.out_rows - 1)
        out_c = np.clip(uc * g.out_cols // max(g.cols, 1), 0, g.out_cols - 1)
        tokens.append(np.where(shown, side * side + out_r * (g.out_cols + 1) + out_c, -1))
        raster.append(full_r * (g.tiles_w * side) + full_c)
        views.append(1)
    return CropPatches(tuple(tokens), tuple(raster), tuple(views))


def image_layout(config, processor, width: int, height: int) -> ImageLayout:
    """The layout of one image of `width` x `height` pixels in a prompt of this model (config + processor).
    Another family's layout comes from its module (`families`)."""
    if (other := _other_family(config)) is not None:
        return other.image_layout(config, processor, width, height)
    vc = config.vision_config
    side = int(vc.image_size) // int(vc.patch_size)
    mt = getattr(config, "model_type", "llava")
    if mt == "llava":
        image_processor = getattr(processor, "image_processor", None) if processor is not None else None
        box = _centre_square(width, height) if _crops_to_square(image_processor) else (0.0, 0.0, 1.0, 1.0)
        return ImageLayout((GridView("image", side, side, box),), (width, height))
    if mt in ("llava_next", "llava_onevision"):
        return anyres_layout(width, height, base_tokens=side * side, **_anyres_args(config))
    raise ValueError(f"no image layout for model_type {mt!r}")


def max_image_tokens(config, processor) -> int:
    """The most tokens one image can take: for anyres, an image of each pinpoint's exact shape (no padding)."""
    if (other := _other_family(config)) is not None:
        return other.max_image_tokens(config, processor)
    vc = config.vision_config
    pins = getattr(config, "image_grid_pinpoints", None)
    if getattr(config, "model_type", "llava") == "llava" or not pins:
        return image_layout(config, processor, int(vc.image_size), int(vc.image_size)).n_tokens
    return max(image_layout(config, processor, int(w), int(h)).n_tokens for h, w in pins)


def image_runs(flags) -> list[tuple[int, int]]:
    """(start, tokens) of each run of consecutive image tokens in a prompt row's flags ([N] bool, a tensor or a
    list): one run per image block where images are separated by text (InternVL's <img> ... </img>)."""
    runs: list[tuple[int, int]] = []
    for p, flag in enumerate(flags.tolist() if hasattr(flags, "tolist") else flags):
        if not flag:
            continue
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs
