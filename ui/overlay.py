"""The uploaded image with the patches a method keeps at one layer lit, and the evicted ones dimmed.

The engine reports, per image patch, the share of KV heads that still hold it (0 = evicted everywhere,
1 = kept by every head). The image is first brought to the square view the vision tower sees (centre
crop when the processor crops, a plain resize otherwise), then each patch cell is blended from its
colour (kept) to a dark grey (evicted).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from .theme import colour

VIEW_SIDE = 336  # pixels of the rendered overlay


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


def overlay(image: Image.Image, share: np.ndarray | None, method: str = "", crop: bool = False,
            side: int = VIEW_SIDE) -> Image.Image:
    """Blend `share` ([rows, cols] in [0, 1]) over the image's model view; None -> the plain view."""
    view = model_view(image, crop, side)
    if share is None:
        return view
    share = np.clip(np.asarray(share, dtype=np.float32), 0.0, 1.0)
    rows, cols = share.shape
    mask = Image.fromarray((share * 255).astype(np.uint8), mode="L").resize((side, side), Image.Resampling.NEAREST)
    s = np.asarray(mask, dtype=np.float32)[..., None] / 255.0
    rgb = np.asarray(view, dtype=np.float32)
    grey = rgb @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    dark = np.repeat(grey[..., None] * 0.28 + 18, 3, axis=-1)
    out = Image.fromarray(np.clip(s * rgb + (1 - s) * dark, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(out, "RGBA")
    for r in range(1, rows):
        y = round(r * side / rows)
        draw.line([(0, y), (side, y)], fill=(255, 255, 255, 40), width=1)
    for c in range(1, cols):
        x = round(c * side / cols)
        draw.line([(x, 0), (x, side)], fill=(255, 255, 255, 40), width=1)
    if method:
        draw.rectangle([(0, 0), (side - 1, side - 1)], outline=colour(method), width=4)
    return out


def caption(label: str, share: np.ndarray | None, layer: int) -> str:
    """'H2O · layer 3 · 41 of 144 patches kept (mean head share 28%)'."""
    if share is None:
        return f"{label} · layer {layer} · no image tokens"
    share = np.asarray(share, dtype=float)
    kept = int((share > 0).sum())
    return f"{label} · layer {layer} · {kept} of {share.size} patches kept · mean share {share.mean():.0%}"
