"""The kept-patch overlay of a comparison with several images or a video: every image drawn with its own views
(overlay.py), then the video's frames as a strip of small tiles, each tile with a bar under it filled to the
share of that image's (that frame's) tokens the method's cache holds at the layer. One image and no video is
drawn exactly as overlay.py always drew it.

Each image's share is the mean over its image tokens of the share of KV heads that hold them (the
`KeptImageMap`'s token shares within the image's range of tokens)."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from prefixkv_core.models.layout import ImageLayout
from prefixkv_core.report.events import KeptImageMap

from .overlay import _views_overlay, caption, overlay
from .runstate import ShownVisuals
from .theme import colour

MAX_ROW_WIDTH = 1344  # tiles wrap to a new row past this width
GAP = 8
BAR = 16  # pixels of the bar (and its text) under each tile
BORDER = 4
FONT_SIZE = 12


@functools.lru_cache(maxsize=1)
def _font() -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=FONT_SIZE)  # Pillow's bundled font, scalable where FreeType is built in
    except (TypeError, ValueError, OSError):
        return ImageFont.load_default()


def image_shares(share: Any) -> list[float]:
    """Per image (or frame) of the layout, the mean kept share of its tokens at the map's layer."""
    tokens = np.asarray(share.token_share, dtype=np.float64)
    return [float(tokens[a:b].mean()) if b > a else 0.0 for a, b in share.layout.image_ranges()]


def _image_map(share: KeptImageMap, i: int) -> KeptImageMap:
    """The map of image i alone: its views (those with patches: a video's closing newline token has none) over its
    own range of tokens (an image's tokens are contiguous, its views in order)."""
    layout = share.layout
    start, stop = layout.image_ranges()[i]
    views, tokens, merged, at = [], [], [], start
    for k in layout.image_views(i):
        view = layout.views[k]
        if view.n_patches:
            views.append(view)
            tokens.append(share.token_share[at:at + view.n_tokens])
            if share.merged_share is not None:
                merged.append(share.merged_share[at:at + view.n_tokens])
        at += view.n_tokens
    join = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32))
    return KeptImageMap(ImageLayout(tuple(views), layout.sizes()[min(i, len(layout.sizes()) - 1)]), join(tokens),
                        join(merged) if share.merged_share is not None else None)


def _tile_sides(shown: ShownVisuals) -> tuple[int, int]:
    """(image tile height, frame tile height): smaller the more there are."""
    n_images, n_frames = shown.kinds.count("image"), shown.kinds.count("frame")
    image_side = 336 if n_images <= 2 else 224 if n_images <= 6 else 160
    return image_side, 128 if n_frames <= 16 else 96


def _name(shown: ShownVisuals, i: int) -> str:
    """'image 2' or 'frame 3 · 1.5 s'."""
    kind = shown.kinds[i]
    number = shown.kinds[:i + 1].count(kind)
    t = shown.times[i]
    return f"{kind} {number}" + (f" · {t:.1f} s" if t is not None else "")


def _plain(picture: Image.Image, side: int) -> Image.Image:
    w, h = picture.size
    return picture.convert("RGB").resize((max(1, round(side * w / max(h, 1))), side), Image.Resampling.BICUBIC)


def _tile_text(shown: ShownVisuals, i: int, share: float) -> str:
    """Under an image: 'image 2 · 41%'; under a frame: '1.5 s · 41%'."""
    t = shown.times[i]
    if shown.kinds[i] == "frame" and t is not None:
        return f"{t:.1f} s · {share:.0%}"
    return f"{_name(shown, i)} · {share:.0%}"


def _tile(picture: Image.Image, share: float, text: str, method: str) -> Image.Image:
    """The picture with a bar under it, filled to `share` in the method's colour, and its text."""
    w, h = picture.size
    out = Image.new("RGB", (w, h + BAR), (24, 24, 24))
    out.paste(picture, (0, 0))
    draw = ImageDraw.Draw(out)
    draw.rectangle([(0, h), (max(0, round(w * min(max(share, 0.0), 1.0)) - 1), h + BAR - 1)],
                   fill=colour(method) if method else (200, 200, 200))
    draw.text((4, h + 1), text, fill=(255, 255, 255), font=_font(), stroke_width=2, stroke_fill=(0, 0, 0))
    return out


def _rows(tiles: list[Image.Image]) -> list[list[Image.Image]]:
    rows: list[list[Image.Image]] = [[]]
    width = 0
    for tile in tiles:
        if rows[-1] and width + GAP + tile.width > MAX_ROW_WIDTH:
            rows.append([])
            width = 0
        width += tile.width + (GAP if rows[-1] else 0)
        rows[-1].append(tile)
    return [r for r in rows if r]


def _stack(rows: list[list[Image.Image]], method: str) -> Image.Image:
    """Rows of tiles, left aligned, inside the method's coloured border."""
    widths = [sum(t.width for t in row) + GAP * (len(row) - 1) for row in rows]
    heights = [max(t.height for t in row) for row in rows]
    pad = BORDER + 2
    out = Image.new("RGB", (max(widths) + 2 * pad, sum(heights) + GAP * (len(rows) - 1) + 2 * pad), (0, 0, 0))
    y = pad
    for row, height in zip(rows, heights):
        x = pad
        for tile in row:
            out.paste(tile, (x, y))
            x += tile.width + GAP
        y += height + GAP
    if method:
        ImageDraw.Draw(out).rectangle([(0, 0), (out.width - 1, out.height - 1)], outline=colour(method),
                                      width=BORDER)
    return out


def visuals_overlay(shown: ShownVisuals, share: Any, method: str = "", crop: bool = False) -> Image.Image:
    """The overlay of one method at one layer over every image and frame (see the module doc)."""
    if shown.single or share is None or not hasattr(share, "layout"):
        return overlay(shown.images[0], share, method, crop)
    layout = share.layout
    count = min(len(shown.images), layout.n_images)
    shares = image_shares(share)
    image_side, frame_side = _tile_sides(shown)
    image_tiles, frame_tiles = [], []
    for i in range(count):
        frame = shown.kinds[i] == "frame"
        side = frame_side if frame else image_side
        own = _image_map(share, i)
        picture = _views_overlay(shown.images[i], own, "", side, labels=not frame and len(own.layout.views) > 1) \
            if own.layout.views else _plain(shown.images[i], side)
        tile = _tile(picture, shares[i], _tile_text(shown, i, shares[i]), method)
        (frame_tiles if frame else image_tiles).append(tile)
    rows = _rows(image_tiles) + _rows(frame_tiles)
    return _stack(rows, method)


def visuals_caption(label: str, share: Any, layer: int, shown: ShownVisuals) -> str:
    """overlay.caption for one image; with several images or frames, also each one's kept share:
    '… · image 1 54% · image 2 30% · frames 0.0 s 12% · 1.2 s 0% …'."""
    if shown.single or share is None or not hasattr(share, "layout"):
        return caption(label, share, layer)
    shares = image_shares(share)
    head = (f"{label} · layer {layer} · {share.kept_tokens()} of {share.n_tokens} image tokens kept · "
            f"mean share {share.mean_share():.0%}")
    images = [f"{_name(shown, i)} {s:.0%}" for i, s in enumerate(shares[:len(shown.kinds)])
              if shown.kinds[i] == "image"]
    frames = [f"{shown.times[i]:.1f} s {s:.0%}" for i, s in enumerate(shares[:len(shown.kinds)])
              if shown.kinds[i] == "frame" and shown.times[i] is not None]
    parts = [head, *images]
    if frames:
        parts.append("frames " + " · ".join(frames))
    return " · ".join(parts)
