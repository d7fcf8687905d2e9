"""The uploaded image with the patches a method keeps at one layer lit, and the evicted ones dimmed.

The engine reports, per image token, the share of KV heads that still hold it (0 = evicted everywhere,
1 = kept by every head), placed on the views the model saw (`KeptImageMap`). Every view is drawn over the
original image, one panel each, side by side: the patch grid over the part of the image that view covers
(the rest, e.g. what a CLIP centre crop cut away, is darkened), each patch cell blended from its colour
(kept) to a dark grey (evicted). Anyres models (LLaVA-NeXT, OneVision) get two panels: the base view and
the high-resolution tiles (tile borders drawn), with a strip at the right of the tiles for the image-newline
token that closes each row. So every image token of the prompt has exactly one cell.

After a vision-side reduction (VisionZip, Downsample) the language model saw fewer image tokens than the prompt
had: a patch kept as a dominant token is lit as above; a patch merged into a contextual token, or averaged into a
pooled one, is drawn half lit and hatched (its content lives on, averaged with others, in a token the cache
holds); a patch in neither is dark.

A plain [rows, cols] array is still drawn the old way, on the square the vision tower sees.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from .theme import colour

VIEW_SIDE = 336  # pixels of the rendered overlay (the height of each panel)
NEWLINE_STRIP = 10  # pixels of the newline-token strip right of a panel
PANEL_GAP = 8
MAX_PANEL_ASPECT = 2.5  # a very wide image is drawn at most this wide per panel


def crops_to_square(image_processor: Any) -> bool:
    """Whether a (duck-typed) image processor centre-crops instead of resizing to a square."""
    return bool(getattr(image_processor, "do_center_crop", False))


def model_view(image: Image.Image, crop: bool, side: int = VIEW_SIDE) -> Image.Image:
    """The square the vision tower looks at: centre crop (CLIP-style) or resize (SigLIP-style)."""
    image = image.convert("RGB")
    if crop:
        w, h = image.size
        s = min(w, h)
        left, top = (w - s) // 2, (h - s) // 2
        image = image.crop((left, top, left + s, top + s))
    return image.resize((side, side), Image.Resampling.BICUBIC)


def overlay(image: Image.Image, share: Any, method: str = "", crop: bool = False,
            side: int = VIEW_SIDE) -> Image.Image:
    """Blend `share` over the image: a `KeptImageMap` (every view of the image, see the module doc), or a
    [rows, cols] array in [0, 1] over the model's square view; None -> the plain view."""
    if share is not None and hasattr(share, "layout"):
        return _views_overlay(image, share, method, side)
    view = model_view(image, crop, side)
    if share is None:
        return view
    out = _blend_grid(view, np.asarray(share, dtype=np.float32), (0, 0, side, side))
    if method:
        ImageDraw.Draw(out).rectangle([(0, 0), (side - 1, side - 1)], outline=colour(method), width=4)
    return out


def _dark(rgb: np.ndarray) -> np.ndarray:
    grey = rgb @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    return np.repeat(grey[..., None] * 0.28 + 18, 3, axis=-1)


MERGED_LIGHT = 0.45  # how lit a patch that lives on only inside a contextual token is drawn


def _blend_grid(img: Image.Image, share: np.ndarray, box: tuple[int, int, int, int],
                tile_rows=(), tile_cols=(), merged: np.ndarray | None = None,
                faded: np.ndarray | None = None) -> Image.Image:
    """Blend each cell of `share` ([rows, cols] in [0, 1]) over `box` (pixels) of `img`; grid and tile lines.
    `merged` ([rows, cols]): cells kept only inside a contextual token, drawn half lit and hatched. `faded`:
    the dark version of `img`'s `box` (`_faded`, any float type), when already computed."""
    share = np.clip(share, 0.0, 1.0)
    only_merged = None
    if merged is not None:
        only_merged = (np.asarray(merged) > 0) & (share <= 0)
        share = np.where(only_merged, MERGED_LIGHT * np.clip(merged, 0.0, 1.0), share)
    rows, cols = share.shape
    left, top, right, bottom = box
    w, h = max(right - left, 1), max(bottom - top, 1)
    mask = Image.fromarray((share * 255).astype(np.uint8), mode="L").resize((w, h), Image.Resampling.NEAREST)
    s = np.asarray(mask, dtype=np.float32)[..., None] / 255.0
    rgb = np.array(img, dtype=np.float32)  # a copy of its own: the box is written in place
    part = rgb[top:top + h, left:left + w]
    dark = faded if faded is not None else _dark(part)
    rgb[top:top + h, left:left + w] = s * part + (1 - s) * dark
    out = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(out, "RGBA")
    if min(w / cols, h / rows) >= 5:  # patch lines only where cells are big enough to see
        for r in range(1, rows):
            y = top + round(r * h / rows)
            draw.line([(left, y), (right, y)], fill=(255, 255, 255, 40), width=1)
        for c in range(1, cols):
            x = left + round(c * w / cols)
            draw.line([(x, top), (x, bottom)], fill=(255, 255, 255, 40), width=1)
    if only_merged is not None and only_merged.any():
        cw, ch = w / cols, h / rows
        for r, c in zip(*np.nonzero(only_merged)):
            x0, y0 = left + c * cw, top + r * ch
            draw.line([(x0, y0 + ch), (x0 + cw, y0)], fill=(255, 255, 255, 150), width=1)
    for f in tile_rows:  # where the crops the vision tower saw meet
        y = top + round(f * h)
        draw.line([(left, y), (right, y)], fill=(255, 255, 255, 170), width=2)
    for f in tile_cols:
        x = left + round(f * w)
        draw.line([(x, top), (x, bottom)], fill=(255, 255, 255, 170), width=2)
    return out


def _faded(img: Image.Image, box: tuple[int, int, int, int]) -> np.ndarray:
    """The dark grey `img`'s `box` fades to where a patch was evicted, at half precision (kept per image)."""
    left, top, right, bottom = box
    return _dark(np.asarray(img, dtype=np.float32)[top:bottom, left:right]).astype(np.float16)


# The last images' views as drawn under every method's patches: each redraw draws every method over the same image,
# and resizing it and darkening what each view never saw is most of a panel's cost. Keyed by the image object's id
# and checked against a weak reference to it (an id may be reused once its image is gone; images are not hashable).
_VIEWS: "OrderedDict[tuple, tuple[weakref.ref, tuple[int, list]]]" = OrderedDict()
_VIEWS_KEPT = 16  # about 1 MB each for a square image of one view
_VIEWS_LOCK = threading.Lock()  # several visitors' redraws run at once


def _view_backdrops(image: Image.Image, views, side: int) -> tuple[int, list]:
    """(panel width, per view: (its pixel box, the image with the rest darkened, `_faded` of that box))."""
    boxes = tuple(view.box for view in views)
    key = (id(image), side, boxes)
    with _VIEWS_LOCK:
        entry = _VIEWS.get(key)
        if entry is not None and entry[0]() is image:
            _VIEWS.move_to_end(key)
            return entry[1]
    rgb_image = image.convert("RGB")
    iw, ih = rgb_image.size
    width = int(round(side * min(max(iw / max(ih, 1), 1 / MAX_PANEL_ASPECT), MAX_PANEL_ASPECT)))
    rgb = np.asarray(rgb_image.resize((width, side), Image.Resampling.BICUBIC), dtype=np.float32)
    dark = _dark(rgb)
    out = []
    for left, top, right, bottom in boxes:
        box = (round(left * width), round(top * side), round(right * width), round(bottom * side))
        outside = np.ones((side, width, 1), dtype=np.float32)
        outside[box[1]:box[3], box[0]:box[2]] = 0.0  # the view never saw the rest: darken it
        shown = Image.fromarray(np.clip(outside * dark + (1 - outside) * rgb, 0, 255).astype(np.uint8))
        out.append((box, shown, _faded(shown, box)))
    with _VIEWS_LOCK:
        _VIEWS[key] = (weakref.ref(image), (width, out))
        while len(_VIEWS) > _VIEWS_KEPT:
            _VIEWS.popitem(last=False)
    return width, out


def _views_overlay(image: Image.Image, kept, method: str, side: int, labels: bool = True) -> Image.Image:
    """One panel per view of the image, side by side (see the module doc); `labels`: name each view in its
    corner."""
    width, backdrops = _view_backdrops(image, kept.layout.views, side)
    panels = []
    for i, (view, (box, shown, faded)) in enumerate(zip(kept.layout.views, backdrops)):
        merged = kept.view_merged(i) if hasattr(kept, "view_merged") else None
        panel = _blend_grid(shown, kept.view_share(i), box, view.tile_rows, view.tile_cols, merged, faded)
        newline = kept.newline_share(i)
        if newline is not None:
            strip = Image.new("RGB", (NEWLINE_STRIP, side), (24, 24, 24))
            draw = ImageDraw.Draw(strip)
            row_h = (box[3] - box[1]) / view.rows
            for r, v in enumerate(np.clip(newline, 0.0, 1.0)):
                grey = int(40 + 200 * v)
                y0, y1 = round(box[1] + r * row_h), round(box[1] + (r + 1) * row_h)
                draw.rectangle([(1, y0), (NEWLINE_STRIP - 2, max(y0, y1 - 1))], fill=(grey, grey, grey))
            joined = Image.new("RGB", (panel.width + NEWLINE_STRIP + 2, side), (0, 0, 0))
            joined.paste(panel, (0, 0))
            joined.paste(strip, (panel.width + 2, 0))
            panel = joined
        if view.box != (0.0, 0.0, 1.0, 1.0):  # the part of the image this view covers
            ImageDraw.Draw(panel).rectangle([box[:2], (box[2] - 1, box[3] - 1)], outline=(235, 235, 235), width=2)
        if labels:
            label = f"{view.name} {view.rows}x{view.cols}" + (" + newline" if view.newline else "")
            ImageDraw.Draw(panel, "RGBA").text((6, 4), label, fill=(255, 255, 255, 230), stroke_width=2,
                                               stroke_fill=(0, 0, 0, 200))
        panels.append(panel)
    total = sum(p.width for p in panels) + PANEL_GAP * (len(panels) - 1)
    out = Image.new("RGB", (total, side), (0, 0, 0))
    x = 0
    for p in panels:
        out.paste(p, (x, 0))
        x += p.width + PANEL_GAP
    if method:
        ImageDraw.Draw(out).rectangle([(0, 0), (total - 1, side - 1)], outline=colour(method), width=4)
    return out


def caption(label: str, share: Any, layer: int) -> str:
    """'H2O · layer 3 · 41 of 144 patches kept · mean share 28%'; for an anyres `KeptImageMap`, the image tokens
    of every view ('… 98 of 188 image tokens kept (base 9/16 · tiles 85/160 + newline 4/12) …')."""
    if share is None:
        return f"{label} · layer {layer} · no image tokens"
    if hasattr(share, "layout"):
        parts = []
        for i, view in enumerate(share.layout.views):
            grid = share.view_share(i)
            text = f"{view.name} {int((grid > 0).sum())}/{grid.size}"
            newline = share.newline_share(i)
            if newline is not None:
                text += f" + newline {int((newline > 0).sum())}/{newline.size}"
            parts.append(text)
        views = share.layout.views
        what = "patches" if len(views) == 1 and not views[0].newline else "image tokens"
        detail = f" ({' · '.join(parts)})" if what != "patches" else ""
        merged = share.merged_tokens() if hasattr(share, "merged_tokens") else 0
        also = f" (+ {merged} merged into pooled or contextual tokens)" if merged else ""
        return (f"{label} · layer {layer} · {share.kept_tokens()} of {share.n_tokens} {what} kept{also}{detail} · "
                f"mean share {share.mean_share():.0%}")
    share = np.asarray(share, dtype=float)
    kept = int((share > 0).sum())
    return f"{label} · layer {layer} · {kept} of {share.size} patches kept · mean share {share.mean():.0%}"
