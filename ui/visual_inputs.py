"""The inputs beside the single image: more images (a gallery, in the order shown) and a video, checked at the
boundary like the image (inputs.py `checked_image`).

Gradio's own preprocessing would open whatever path a client names; these components never run it. A gallery
image is taken only as a data URL or a file in Gradio's upload folder or the shipped examples, bounded in bytes
and pixels before it is decoded. A video is taken only as such a file: confined and measured without decoding,
then its stream's header is read (only the demuxers the engine allows) so the frames' size is known before a
single frame is decoded. Several images are downscaled more the more there are, so a request's images hold a
bounded number of pixels.
"""
from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import av
import gradio as gr
from PIL import Image

from prefixkv_core.errors import EngineError
from prefixkv_core.limits import IMAGE_REFUSED, MB, LimitError, Limits, is_inside
from prefixkv_core.session.image_input import MAX_VISUALS
from prefixkv_core.session.video_input import (DEMUXERS, VIDEO_REFUSED, DecodeBounds, VideoClip, check_frames,
                                               load_video)

from .inputs import DEFAULT_LIMITS, MAX_DISPLAY_SIDE, downscale, image_from_payload, refuse, upload_folder

IMAGES_AT_FULL_SIZE = 4  # up to this many images keep MAX_DISPLAY_SIDE; more share the pixels of this many
MIN_IMAGE_SIDE = 512
FRAME_SIDE = 1024  # a video's sampled frames are downscaled to this side once decoded


def side_for(count: int) -> int:
    """The longest side each of `count` images keeps: the pixels of IMAGES_AT_FULL_SIZE full-size images shared
    among them (never below MIN_IMAGE_SIDE)."""
    if count <= IMAGES_AT_FULL_SIZE:
        return MAX_DISPLAY_SIDE
    return max(MIN_IMAGE_SIDE, int(MAX_DISPLAY_SIDE * math.sqrt(IMAGES_AT_FULL_SIZE / count)))


# -- several images --------------------------------------------------------------------------------------------

def checked_gallery(limits: Limits = DEFAULT_LIMITS, roots: Callable[[], Iterable[str]] | None = None,
                    **kwargs) -> gr.Gallery:
    """An interactive gr.Gallery for images only; its value reaches the handler as a list of RGB images in the
    order shown (None when empty). Each is checked as `checked_image` checks one; at most MAX_VISUALS."""
    kwargs.setdefault("file_types", ["image"])
    component = gr.Gallery(type="pil", interactive=True, **kwargs)
    allowed = roots or (lambda: [upload_folder()])

    def preprocess(payload):
        items = list(getattr(payload, "root", None) or [])
        if not items:
            return None
        if len(items) > MAX_VISUALS:
            raise refuse(too_many(len(items)))
        side, folders, images = side_for(len(items)), list(allowed()), []
        for k, item in enumerate(items, 1):
            where = f"images: image {k} of {len(items)}" if len(items) > 1 else "images"
            if getattr(item, "image", None) is None:  # a video in the gallery
                raise refuse(f"{where}: a video is not an image here: put it in the Video input")
            try:
                images.append(downscale(image_from_payload(item.image, limits, folders), side))
            except LimitError as exc:
                raise refuse(f"{where}: {exc}") from None
        return images

    def too_many(count: int) -> str:
        return f"images: {count} images; the limit is {MAX_VISUALS}"

    component.preprocess = preprocess
    component.refusal = f"images: {IMAGE_REFUSED}"
    component.max_items, component.too_many = MAX_VISUALS, too_many  # checked before Gradio walks the list
    return component


# -- a video ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VideoUpload:
    """A video file that passed the boundary: inside the allowed folders, within the byte limit, a stream the
    engine's demuxers read, of `size` (width, height) frames. Nothing is decoded yet."""

    path: str
    size: tuple[int, int]
    bytes: int


def _refused() -> EngineError:
    return EngineError(VIDEO_REFUSED)


def check_video_file(path: Any, roots: Iterable[str], max_bytes: int) -> VideoUpload:
    """A path a client named -> VideoUpload, else EngineError: VIDEO_REFUSED for a file outside `roots`, missing,
    not a regular file or not a video (one sentence whatever the reason); its size only for a file inside them."""
    if not isinstance(path, str) or not path or "\x00" in path or not is_inside(path, list(roots)):
        raise _refused()
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(os.path.realpath(path), flags)  # non-blocking: a FIFO must not hang the server
    except OSError:
        raise _refused() from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _refused()
    if info.st_size > max_bytes:
        os.close(fd)
        raise EngineError(f"the video is {info.st_size / MB:.1f} MB; the limit is {max_bytes / MB:g} MB: "
                          "send a shorter or smaller clip")
    with os.fdopen(fd, "rb") as fh:
        try:  # the header only: no frame is decoded here
            with av.open(fh, options={"format_whitelist": DEMUXERS}) as container:
                streams = container.streams.video
                size = (int(streams[0].codec_context.width), int(streams[0].codec_context.height)) if streams \
                    else (0, 0)
        except (av.FFmpegError, OSError, EOFError, ValueError):
            raise _refused() from None
    if min(size) <= 0:
        raise _refused()
    return VideoUpload(path, size, int(info.st_size))


def checked_video(limits: Limits = DEFAULT_LIMITS, roots: Callable[[], Iterable[str]] | None = None,
                  **kwargs) -> gr.Video:
    """A gr.Video for uploads whose value reaches the handler as a VideoUpload (None when empty)."""
    kwargs.setdefault("sources", ["upload"])
    component = gr.Video(**kwargs)
    allowed = roots or (lambda: [upload_folder()])

    def preprocess(payload):
        if payload is None:
            return None
        try:
            return check_video_file(getattr(payload, "path", None), allowed(), limits.max_video_bytes)
        except EngineError as exc:
            raise refuse(f"video: {exc}") from None

    component.preprocess = preprocess
    component.refusal = f"video: {VIDEO_REFUSED}"
    return component


def load_checked_video(video: Any, frames: Any, limits: Limits, roots: Iterable[str]) -> VideoClip:
    """A VideoUpload (or a path, checked now) sampled to `frames` frames: the frames' pixels together are checked
    against the limit from the header, then decoded by the engine's reader (which checks the file again, every
    decoded frame against the per-frame and total limits, and the decoder's work) and downscaled to FRAME_SIDE.
    Raises EngineError."""
    frames = check_frames(frames)
    roots = list(roots)
    if not isinstance(video, VideoUpload):
        video = check_video_file(video, roots, limits.max_video_bytes)
    w, h = video.size
    if frames * w * h > limits.max_video_pixels:
        fit = max(1, limits.max_video_pixels // (w * h))
        raise EngineError(f"{frames} frames of {w}×{h} pixels are {frames * w * h / 1e6:.0f} megapixels; the limit "
                          f"is {limits.max_video_pixels / 1e6:g}: ask for at most {fit} frames or send a smaller video")
    clip = load_video(video.path, frames, allowed_roots=roots, max_bytes=limits.max_video_bytes,
                      bounds=video_bounds(limits))
    small = tuple(_smaller(f) for f in clip.frames)
    return replace(clip, frames=small, size=small[0].size)


def video_bounds(limits: Limits) -> DecodeBounds:
    """What decoding one client's video may cost, from the server's limits."""
    return DecodeBounds(frame_pixels=limits.max_frame_pixels, clip_pixels=limits.max_video_pixels,
                        decode_pixels=limits.max_video_decode_pixels, decode_s=limits.max_video_decode_s)


def _smaller(frame: Image.Image) -> Image.Image:
    if max(frame.size) <= FRAME_SIDE:
        return frame
    frame = frame.copy()
    frame.thumbnail((FRAME_SIDE, FRAME_SIDE))
    return frame
