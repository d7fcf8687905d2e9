"""The image a comparison is asked about: a PIL image or a path, checked and made RGB before the processor
sees it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from .. import limits
from ..errors import EngineError

MAX_IMAGE_SIDE = 4096  # larger images are downscaled before the processor sees them
MAX_VISUALS = 64  # images and video frames in one turn (the context is the real bound; this one stops abuse first)


def load_image(image: Any, *, allowed_roots: Any = None, max_bytes: int | None = None,
               max_pixels: int | None = None) -> Image.Image | None:
    """None, a PIL image, or a path -> 8-bit RGB PIL image (downscaled if huge; 16-bit greyscale scaled, not
    clipped). Raises EngineError.

    Who may name a path decides how it is opened. A local user (the CLI, a script) may open any file
    they can read, and errors say what went wrong. A server passes `allowed_roots`, the folders its
    clients' images may come from (its upload folder, the shipped examples): a path that does not
    resolve inside one of them, or is missing, a folder, a device or not an image, is refused with
    one message that says nothing about the disk. `max_bytes` / `max_pixels` bound a file before it
    is decoded (and a PIL image's pixels)."""
    if image is None:
        return None
    if isinstance(image, (list, tuple)):
        raise EngineError("load_image takes one image; several images go through load_images")
    if isinstance(image, (str, Path)):
        roots = None if allowed_roots is None else [allowed_roots] if isinstance(allowed_roots, (str, Path)) \
            else list(allowed_roots)
        try:
            image = limits.read_image_file(image, roots, max_bytes=max_bytes, max_pixels=max_pixels)
        except limits.LimitError as exc:
            raise EngineError(str(exc)) from None
    if not isinstance(image, Image.Image):
        raise EngineError(f"image must be a PIL image or a file path, got {type(image).__name__}")
    if max_pixels is not None and image.size[0] * image.size[1] > max_pixels:
        raise EngineError(f"the image is {image.size[0]}×{image.size[1]} pixels; the limit is "
                          f"{max_pixels / 1e6:g} megapixels")
    image = limits.as_rgb(image)
    if max(image.size) > MAX_IMAGE_SIDE:
        image.thumbnail((MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))
    return image


def load_images(images: Any, **checks: Any) -> list[Image.Image]:
    """None, one image (PIL or path) or a list of them -> the RGB images in order ([] for None), each checked
    as `load_image` does (`checks`: its keyword arguments). At most MAX_VISUALS."""
    if images is None:
        return []
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if len(items) > MAX_VISUALS:
        raise EngineError(f"{len(items)} images in one turn; the limit is {MAX_VISUALS}")
    loaded = []
    for k, item in enumerate(items, 1):
        if item is None:
            raise EngineError(f"image {k} of {len(items)} is empty")
        try:
            loaded.append(load_image(item, **checks))
        except EngineError as exc:
            raise EngineError(f"image {k} of {len(items)}: {exc}" if len(items) > 1 else str(exc)) from None
    return loaded
