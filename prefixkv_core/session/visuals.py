"""What a turn shows the model: its images and a video's sampled frames, in the order the model reads them, and
the prompt placing them. Checked before anything is encoded: marker counts, and whether they fit the context.

A video's frames are read as images (the way LLaVA-Interleave reads video: its frames as a run of images), after
the turn's images. Without markers every image and frame comes before the prompt's text; `<image>` markers place
the images one each, and a `<video>` marker the frames."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image

from .. import limits
from ..errors import EngineError
from ..models import IMAGE_TOKEN, image_markers
from .image_input import MAX_VISUALS

VIDEO_MARKER = "<video>"


@dataclass
class TurnVisuals:
    """A turn's images then its video's frames (`images`, in the model's reading order) and the prompt as the
    model reads it (a `<video>` marker replaced by one `<image>` marker per frame)."""

    images: list[Image.Image]
    prompt: str
    n_images: int = 0  # of `images`, those given as images (the rest are the video's frames)
    video: Any = None  # the VideoClip the frames came from

    @property
    def count(self) -> int:
        return len(self.images)

    def kinds(self) -> list[str]:
        """Per visual: "image" or "frame"."""
        return ["image"] * self.n_images + ["frame"] * (self.count - self.n_images)

    def describe(self) -> dict:
        out: dict[str, Any] = {"images": [list(im.size) for im in self.images[:self.n_images]]}
        if self.video is not None:
            out["video"] = self.video.describe()
        return out


def _place(prompt: str, n_images: int, n_frames: int) -> str:
    """The prompt with its markers checked and a `<video>` marker expanded (EngineError on a mismatch)."""
    marked_images, marked_videos = image_markers(prompt), prompt.count(VIDEO_MARKER)
    if marked_videos and not n_frames:
        raise EngineError(f"the prompt has a {VIDEO_MARKER} marker but no video was given")
    if marked_videos > 1:
        raise EngineError(f"the prompt has {marked_videos} {VIDEO_MARKER} markers; a turn takes one video")
    if not marked_images and not marked_videos:
        return prompt
    if marked_images != n_images:
        raise EngineError(f"the prompt has {marked_images} {IMAGE_TOKEN} marker(s) for {n_images} image(s): "
                          "put one marker where each image goes, or none to put them all first")
    if n_frames and not marked_videos:
        raise EngineError(f"the prompt places its images with markers: place the video with a {VIDEO_MARKER} "
                          "marker too")
    return prompt.replace(VIDEO_MARKER, IMAGE_TOKEN * n_frames)


def _check_fits(loaded, prompt: str, images: list[Image.Image], n_images: int, max_new_tokens: int) -> None:
    """EngineError, before any encoding, when the images and frames would not fit the model's context, naming
    how many of them would."""
    if getattr(loaded, "processor", None) is None or len(images) < 2:
        return  # one image: the encoded prompt is checked as it is (the message names its tokens)
    sizes = [im.size for im in images]
    total = limits.prompt_tokens(loaded, prompt, len(images), image_sizes=sizes) + max_new_tokens
    if total <= loaded.max_context:
        return
    text = total - sum(limits.image_tokens(loaded, s) for s in sizes)
    fit, used = 0, text
    for size in sizes:
        used += limits.image_tokens(loaded, size)
        if used > loaded.max_context:
            break
        fit += 1
    what = f"{n_images} images" if n_images == len(images) else \
        f"{n_images} images and {len(images) - n_images} frames" if n_images else f"{len(images)} frames"
    raise EngineError(f"{what} take {total - text} tokens; with the text and {max_new_tokens} new tokens that is "
                      f"{total}, over the model's context of {loaded.max_context}: at most {fit} of them fit "
                      "(send fewer images, fewer frames or smaller images)")


def gather_visuals(loaded, prompt: str, images: list[Image.Image], video: Any, frames: int | None, *,
                   max_new_tokens: int, first_turn: bool = True) -> TurnVisuals:
    """The turn's images (already loaded) and the video sampled to `frames` (default 8), checked (a first turn's
    against the context too; a follow-up's is checked with the conversation once encoded)."""
    clip = None
    if video is not None:
        from .video_input import DEFAULT_FRAMES, load_video

        clip = load_video(video, DEFAULT_FRAMES if frames is None else frames)
    elif frames is not None:
        from .video_input import check_frames

        check_frames(frames)
    visuals = images + (list(clip.frames) if clip is not None else [])
    if len(visuals) > MAX_VISUALS:
        raise EngineError(f"{len(images)} images and {len(visuals) - len(images)} frames in one turn; the limit "
                          f"is {MAX_VISUALS} in all")
    placed = _place(prompt, len(images), len(visuals) - len(images))
    if first_turn:
        _check_fits(loaded, placed, visuals, len(images), max_new_tokens)
    return TurnVisuals(visuals, placed, len(images), clip)
