"""What a turn shows the model: its images and a video's sampled frames, and the prompt placing them. Checked
before anything is encoded: marker counts, and whether they fit the context.

A video is read the way its family reads one: LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL and Qwen3-VL on their own video
path (OneVision's every frame pooled, Qwen's a merged grid per group of temporal_patch_size frames, Qwen3-VL's each
after its timestamp: `models/video.py`), the other families as a run of images after the turn's images (the way
LLaVA-Interleave reads video). Without markers every image, then the video, comes before the prompt's text;
`<image>` markers place the images (one each), and a `<video>` marker the video."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from .. import limits
from ..errors import EngineError
from ..models import IMAGE_TOKEN, image_markers
from ..models.video import VIDEO_TOKEN, reads_video_natively, video_text_tokens, video_token_count
from .image_input import MAX_VISUALS

VIDEO_MARKER = VIDEO_TOKEN


@dataclass
class TurnVisuals:
    """A turn's visuals and the prompt as the model reads it. `images`: what is encoded as images, in reading order
    (the turn's images with, where its family reads a video as images, the video's frames among them where the
    prompt's `<video>` marker was, that marker replaced by one `<image>` marker per frame); `frames`: a video read
    natively, its frames apart. `frames_at`: how many of the turn's images come before the video."""

    images: list[Image.Image]
    prompt: str
    n_images: int = 0  # the turn's own images (the rest of `images`, if any, are a video's frames)
    video: Any = None  # the VideoClip the frames came from
    frames: list[Image.Image] = field(default_factory=list)
    frames_at: int = 0
    frames_per_view: int = 1  # a native video's frames per token (Qwen's temporal patch: one grid per 2 frames)

    @property
    def count(self) -> int:
        return len(self.images) + len(self.frames)

    @property
    def native_video(self) -> bool:
        return bool(self.frames)

    def in_order(self) -> list[tuple[str, Image.Image]]:
        """Every image and frame as ("image" | "frame", picture), in the order the model reads them."""
        if self.native_video:
            given = [("image", im) for im in self.images]
            return given[:self.frames_at] + [("frame", im) for im in self.frames] + given[self.frames_at:]
        n_frames = len(self.images) - self.n_images
        return [("frame" if self.frames_at <= k < self.frames_at + n_frames else "image", im)
                for k, im in enumerate(self.images)]

    @property
    def video_fps(self) -> float | None:
        """The sampled frames' rate (frames per second of the stream they were drawn from), None if unknown."""
        clip = self.video
        total, fps = getattr(clip, "total_frames", 0), getattr(clip, "fps", 0)
        if not self.frames or not total or not fps:
            return None
        return len(self.frames) / total * fps

    @property
    def video_times(self) -> tuple[float, ...] | None:
        """A native video's frames' seconds in the stream (Qwen3-VL stamps each temporal group with them), None
        without one."""
        times = getattr(self.video, "timestamps", None)
        if not self.frames or times is None or len(times) != len(self.frames):
            return None
        return tuple(float(t) for t in times)

    def layout_order(self) -> list[tuple[str, Image.Image, int | None]]:
        """One (kind, picture, frame index) per image of the prompt's token layout, in reading order: every image
        and frame, but where a native video's token covers several frames (Qwen), the first frame of each group
        (its index among the video's frames; None for an image)."""
        out, frame = [], 0
        step = max(1, self.frames_per_view) if self.native_video else 1
        for kind, picture in self.in_order():
            if kind == "frame":
                if frame % step == 0:
                    out.append((kind, picture, frame))
                frame += 1
            else:
                out.append((kind, picture, None))
        return out

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.in_order()]

    def fingerprint(self) -> int:
        """A 64-bit fingerprint of the request: the prompt and every image's and frame's pixels (what the methods
        that draw at random draw from, with the comparison's seed)."""
        import hashlib

        h = hashlib.sha256(self.prompt.encode())
        for _, picture in self.in_order():
            h.update(f"{picture.size}{picture.mode}".encode())
            h.update(picture.tobytes())
        return int.from_bytes(h.digest()[:8], "little") or 1

    def describe(self) -> dict:
        out: dict[str, Any] = {"images": [list(im.size) for kind, im in self.in_order() if kind == "image"]}
        if self.video is not None:
            out["video"] = {**self.video.describe(), "read_as": "video" if self.native_video else "images"}
        return out


def _place(prompt: str, n_images: int, n_frames: int, native: bool) -> str:
    """The prompt with its markers checked; a `<video>` marker expanded to the frames' `<image>` markers unless the
    video is read natively, where it stays (and is added before the text when there are no markers)."""
    marked_images, marked_videos = image_markers(prompt), prompt.count(VIDEO_MARKER)
    if marked_videos and not n_frames:
        raise EngineError(f"the prompt has a {VIDEO_MARKER} marker but no video was given")
    if marked_videos > 1:
        raise EngineError(f"the prompt has {marked_videos} {VIDEO_MARKER} markers; a turn takes one video")
    if not marked_images and not marked_videos:
        return f"{VIDEO_MARKER}\n{prompt}" if native and n_frames else prompt
    if marked_images != n_images:
        raise EngineError(f"the prompt has {marked_images} {IMAGE_TOKEN} marker(s) for {n_images} image(s): "
                          "put one marker where each image goes, or none to put them all first")
    if n_frames and not marked_videos:
        raise EngineError(f"the prompt places its images with markers: place the video with a {VIDEO_MARKER} "
                          "marker too")
    return prompt if native else prompt.replace(VIDEO_MARKER, IMAGE_TOKEN * n_frames)


def turn_tokens(loaded, visuals: TurnVisuals, max_new_tokens: int) -> tuple[int, list[int]]:
    """A first turn's tokens with several visuals: (the text's, the template and the new tokens included; each image's
    and frame's, at its size, a native video's spread evenly over its frames)."""
    config = loaded.model.config
    per_visual = [limits.image_tokens(loaded, im.size) for im in visuals.images]
    text_prompt = visuals.prompt.replace(VIDEO_MARKER, "") if visuals.native_video else visuals.prompt
    text = limits.prompt_tokens(loaded, text_prompt, len(visuals.images), image_sizes=[]) + int(max_new_tokens)
    if visuals.native_video:  # the video's tokens, spread evenly over its frames (the text around them: the text's)
        n_frames = len(visuals.frames)
        total = video_token_count(config, n_frames, visuals.frames[0].size, loaded.processor)
        text += video_text_tokens(config, n_frames, loaded.processor, visuals.video_times, visuals.video_fps)
        per_visual += [total // n_frames + (1 if k < total % n_frames else 0) for k in range(n_frames)]
    return text, per_visual


def check_fits(loaded, visuals: TurnVisuals, max_new_tokens: int, token_limit: int | None = None) -> int | None:
    """The tokens a first turn with several visuals reaches; EngineError, before any encoding, when they pass
    `token_limit` (at most the model's context, its default), naming how many of the visuals would fit under it.
    None for one image or none (the encoded prompt is checked as it is: the message names its tokens)."""
    if getattr(loaded, "processor", None) is None or visuals.count < 2:
        return None
    limit = int(loaded.max_context) if token_limit is None else min(int(token_limit), int(loaded.max_context))
    text, per_visual = turn_tokens(loaded, visuals, max_new_tokens)
    total = text + sum(per_visual)
    if total <= limit:
        return total
    fit, used = 0, text
    for tokens in per_visual:
        used += tokens
        if used > limit:
            break
        fit += 1
    over = f"the model's context of {limit}" if limit == int(loaded.max_context) else f"this run's limit of {limit}"
    counts = ((visuals.n_images, "image"), (visuals.count - visuals.n_images, "frame"))
    what = " and ".join(f"{n} {word}{'s' if n != 1 else ''}" for n, word in counts if n)
    raise EngineError(f"{what} take {total - text} tokens; with the text and {max_new_tokens} new tokens that is "
                      f"{total}, over {over}: at most {fit} of them fit (send fewer images, fewer frames or smaller "
                      "images, or lower max new tokens)")


def gather_visuals(loaded, prompt: str, images: list[Image.Image], video: Any, frames: int | None, *,
                   max_new_tokens: int, first_turn: bool = True, token_limit: int | None = None) -> TurnVisuals:
    """The turn's images (already loaded) and the video sampled to `frames` (default 8), checked (a first turn's
    against `token_limit`, the model's context at most; a follow-up's is checked with the conversation once
    encoded)."""
    clip = None
    if video is not None:
        from .video_input import DEFAULT_FRAMES, load_video

        clip = load_video(video, DEFAULT_FRAMES if frames is None else frames)
    elif frames is not None:
        from .video_input import check_frames

        check_frames(frames)
    frame_list = list(clip.frames) if clip is not None else []
    if len(images) + len(frame_list) > MAX_VISUALS:
        raise EngineError(f"{len(images)} images and {len(frame_list)} frames in one turn; the limit is "
                          f"{MAX_VISUALS} in all")
    config = getattr(getattr(loaded, "model", None), "config", None)
    native = bool(frame_list) and config is not None and reads_video_natively(config)
    placed = _place(prompt, len(images), len(frame_list), native)
    # the video's place among the images: where its marker is, else after them
    at = prompt.find(VIDEO_MARKER)
    frames_at = image_markers(prompt[:at]) if frame_list and at >= 0 and image_markers(prompt) else len(images)
    if native:
        from ..models.video import frames_per_token

        visuals = TurnVisuals(images, placed, len(images), clip, frame_list, frames_at,
                              frames_per_token(config, getattr(loaded, "processor", None)))
    else:
        visuals = TurnVisuals(images[:frames_at] + frame_list + images[frames_at:], placed, len(images), clip,
                              frames_at=frames_at)
    if first_turn:
        check_fits(loaded, visuals, max_new_tokens, token_limit)
    return visuals
