"""A first turn's visuals as a request brings them: the image, then the gallery's images, and a video sampled to
its frames; the run they make checked against the server's token limit; and the small copies the overlay draws,
in the order the engine session reads them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from PIL import Image

from prefixkv_core import EngineError
from prefixkv_core.limits import LimitError, Limits, check_prompt, check_text, run_token_limit
from prefixkv_core.session.image_input import MAX_VISUALS
from prefixkv_core.session.video_input import DEFAULT_FRAMES, VideoClip, check_frames
from prefixkv_core.session.visuals import check_fits

from .inputs import downscale
from .runstate import ShownVisuals
from .visual_inputs import load_checked_video, side_for

ONE_IMAGE_SIDE = 1024  # the display copy of a lone image (the overlay draws it at 336 pixels high)
IMAGE_SIDE = 512  # of each of several images
FRAME_SIDE = 256  # of each video frame (drawn small, in a strip)


@dataclass
class RequestVisuals:
    """The images (model order) and the video clip of a first turn, as the engine takes them."""

    images: list[Image.Image]
    clip: VideoClip | None = None

    @property
    def frames(self) -> list[Image.Image]:
        return list(self.clip.frames) if self.clip is not None else []

    def engine_images(self) -> Any:
        """What `Engine.new_session` takes as its images: None, the one image, or the list."""
        if not self.images:
            return None
        return self.images[0] if len(self.images) == 1 else list(self.images)


def gather(engine, image: Any, images: Any, video: Any, frames: Any, limits: Limits,
           roots: Iterable[str]) -> RequestVisuals:
    """The image (already checked, or a path checked now), the gallery's images, and the video sampled to `frames`
    frames. Raises EngineError."""
    roots = list(roots)
    items = [] if image is None else [image]
    if images is not None:
        if not isinstance(images, (list, tuple)):
            raise EngineError(f"images must be a list of images, got {type(images).__name__}")
        items += [im[0] if isinstance(im, tuple) else im for im in images]  # gallery items may carry captions
    if len(items) > MAX_VISUALS:
        raise EngineError(f"{len(items)} images; the limit is {MAX_VISUALS}")
    side, loaded = side_for(len(items)), []
    for k, item in enumerate(items, 1):
        try:
            loaded.append(downscale(engine.load_image(item, allowed_roots=roots, max_bytes=limits.max_image_bytes,
                                                      max_pixels=limits.max_image_pixels), side))
        except EngineError as exc:
            raise EngineError(f"image {k} of {len(items)}: {exc}" if len(items) > 1 else str(exc)) from None
    clip = None
    if video is not None:
        frames = check_frames(DEFAULT_FRAMES if frames is None else frames)
        try:
            clip = load_checked_video(video, frames, limits, roots)
        except EngineError as exc:
            raise EngineError(f"video: {exc}") from None
    return RequestVisuals(loaded, clip)


def check_first_turn(limits: Limits, loaded, prompt: str, visuals, max_new_tokens: int) -> int:
    """The first turn within the limits, every image and frame counted at its size; returns the tokens the run may
    reach. `visuals`: the engine session's `TurnVisuals` (the prompt as placed, what is encoded as images, and a
    video's frames where the family reads video natively). One image (or none) is checked as before
    (`check_prompt`); several are counted as the engine counted them when it held them to the same limit
    (`new_session(token_limit=...)`), so this check never gives other advice. Raises LimitError."""
    if visuals.count <= 1:
        pictures = list(visuals.images) + list(getattr(visuals, "frames", None) or [])
        return check_prompt(limits, loaded, prompt, with_image=bool(pictures), max_new_tokens=max_new_tokens,
                            image_size=pictures[0].size if pictures else None)
    check_text(limits, loaded, prompt)
    try:
        return check_fits(loaded, visuals, max_new_tokens, run_token_limit(limits, loaded))
    except EngineError as exc:
        raise LimitError(str(exc)) from None


def shown(session, clip: VideoClip | None) -> ShownVisuals | None:
    """Small copies of an engine session's images and frames, in the order its model reads them, for the overlay
    (a comparison keeps them as long as its answers)."""
    order = session.visuals.layout_order()  # a native video whose tokens cover 2 frames (Qwen): each group's first
    pictures, kinds = [p for _, p, _ in order], [k for k, _, _ in order]
    if not pictures:
        return None
    one = kinds == ["image"]
    stamps = list(clip.timestamps) if clip is not None else []
    sides = {"image": ONE_IMAGE_SIDE if one else IMAGE_SIDE, "frame": FRAME_SIDE}
    return ShownVisuals([downscale(p, sides[k]) for p, k in zip(pictures, kinds)], kinds,
                        [stamps[f] if f is not None and f < len(stamps) else None for _, _, f in order])
