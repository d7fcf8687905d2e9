"""Pixels: background arrays (plain, gradient, two-tone) and the filled shapes."""
from __future__ import annotations

import numpy as np
from PIL import ImageDraw

from .records import SceneObject
from .vocabulary import BACKGROUNDS, COLOURS


def background_array(kind: str, tones: list[str], direction: str, size: int) -> np.ndarray:
    a = np.array(BACKGROUNDS[tones[0]], dtype=np.float32)
    if kind == "plain":
        return np.broadcast_to(a, (size, size, 3)).astype(np.uint8)
    b = np.array(BACKGROUNDS[tones[1]], dtype=np.float32)
    if kind == "gradient":
        t = np.linspace(0.0, 1.0, size, dtype=np.float32)
    else:  # two-tone split in the middle
        t = (np.arange(size) >= size // 2).astype(np.float32)
    if direction == "vertical":  # varies from top to bottom
        t = t[:, None, None]
    else:  # varies from left to right
        t = t[None, :, None]
    arr = a * (1 - t) + b * t
    return np.broadcast_to(arr, (size, size, 3)).round().astype(np.uint8)


def shape_polygon(shape: str, x: float, y: float, r: float) -> list[tuple[float, float]] | None:
    if shape == "square":
        h = r * 0.85
        return [(x - h, y - h), (x + h, y - h), (x + h, y + h), (x - h, y + h)]
    if shape == "triangle":
        yc = y + r * 0.12  # optical centring
        return [
            (x + r * np.cos(a), yc + r * np.sin(a))
            for a in np.deg2rad([-90.0, 30.0, 150.0])
        ]
    if shape == "star":
        pts = []
        for i in range(10):
            rad = r if i % 2 == 0 else r * 0.45
            a = np.deg2rad(-90.0 + 36.0 * i)
            pts.append((x + rad * np.cos(a), y + 0.05 * r + rad * np.sin(a)))
        return pts
    if shape == "diamond":
        return [(x, y - r), (x + 0.72 * r, y), (x, y + r), (x - 0.72 * r, y)]
    if shape == "cross":
        t = r * 0.33
        return [
            (x - t, y - r), (x + t, y - r), (x + t, y - t), (x + r, y - t),
            (x + r, y + t), (x + t, y + t), (x + t, y + r), (x - t, y + r),
            (x - t, y + t), (x - r, y + t), (x - r, y - t), (x - t, y - t),
        ]
    return None


def draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject, side: int) -> None:
    x, y, r = obj.cx * side, obj.cy * side, obj.radius * side
    fill = COLOURS[obj.colour]
    if obj.shape == "circle":
        draw.ellipse([x - r, y - r, x + r, y + r], fill=fill)
    else:
        pts = shape_polygon(obj.shape, x, y, r)
        draw.polygon([(float(px), float(py)) for px, py in pts], fill=fill)
