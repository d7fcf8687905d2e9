"""The video a comparison is asked about: a file, or frames already decoded, sampled to a few RGB frames.

The engine decodes video itself with PyAV (which brings its own FFmpeg) and hands the sampled PIL frames to
each family's image processor. transformers' video processors need torchvision, and PyPI's torchvision does
not match the CPU torch wheel on these machines, so they are not used.

Sampling: `frames` indices spread over the whole stream, `np.linspace(0, total - 1, frames, dtype=int)`, as
lmms-eval and transformers sample; a stream with fewer frames than asked gives every frame once (`describe()`
then shows frames == total_frames). Frame i is stamped i / fps seconds (fps: the stream's average rate, as
lmms-eval stamps its frames; AVI stores no presentation times worth trusting). The stream is decoded in
order and only the sampled frames are kept. When the container does not say how many frames its stream
holds (Matroska/WebM), a first pass counts the stream's packets without decoding them; when decoding then
finds another count (a damaged file), the frames are sampled again from the count decoded.

Paths follow image_input's rules: a server passes `allowed_roots`, and a file outside them, missing, a
folder, or not a video is refused with VIDEO_REFUSED, which says nothing about the disk; a local caller
gets precise messages. Only the MP4/MOV, Matroska/WebM and AVI demuxers are allowed, so FFmpeg never
follows playlists or other files named inside a file.
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image

from .. import limits
from ..errors import EngineError

DEFAULT_FRAMES = 8
MAX_FRAMES = 64
MAX_VIDEO_BYTES = 64 * limits.MB
MAX_FRAME_SIDE = 4096  # decoded frames larger than this are downscaled, as images are
MAX_VIDEO_PIXELS = 4096 * 4096  # a stream with larger frames is refused before it is decoded
ACCEPTED_VIDEOS = "MP4, MOV, WebM, MKV or AVI"
DEMUXERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi"
VIDEO_REFUSED = f"not a readable video: send the video itself ({ACCEPTED_VIDEOS}) as an upload"


@dataclass(frozen=True)
class VideoClip:
    """Sampled RGB frames and where they sit in the stream. `size` is the frames' (width, height);
    `total_frames` counts the stream's frames; `source` is the file name alone."""

    frames: tuple[Image.Image, ...]
    timestamps: tuple[float, ...]
    fps: float
    duration_s: float
    total_frames: int
    size: tuple[int, int]
    source: str

    def describe(self) -> dict:
        return {"source": self.source, "frames": len(self.frames), "total_frames": self.total_frames,
                "fps": round(self.fps, 3), "duration_s": round(self.duration_s, 3), "size": list(self.size),
                "timestamps": [round(t, 3) for t in self.timestamps]}


def sample_indices(total: int, frames: int) -> list[int]:
    """`frames` indices spread uniformly over `total` frames; all of them when there are no more than asked."""
    if total <= frames:
        return list(range(total))
    return np.linspace(0, total - 1, frames, dtype=int).tolist()


def check_frames(frames: Any) -> int:
    """The frames knob as an int in 1..MAX_FRAMES, else EngineError (bools and strings are refused)."""
    if isinstance(frames, bool) or not isinstance(frames, numbers.Integral) or not 1 <= frames <= MAX_FRAMES:
        raise EngineError(f"frames must be a whole number from 1 to {MAX_FRAMES}, got {frames!r}")
    return int(frames)


def load_video(video: Any, frames: int = DEFAULT_FRAMES, *, allowed_roots: Any = None,
               max_bytes: int | None = None) -> VideoClip | None:
    """None, a path, a VideoClip or a list of PIL frames -> a VideoClip of `frames` frames (fewer when the
    video has fewer). A VideoClip with more frames than asked is sampled again from its own frames; a list of
    frames has no known rate, so it is taken as 1 fps. `max_bytes` (default MAX_VIDEO_BYTES) bounds the file
    before it is opened. Raises EngineError."""
    frames = check_frames(frames)
    if video is None:
        return None
    if isinstance(video, VideoClip):
        keep = sample_indices(len(video.frames), frames)
        return VideoClip(tuple(video.frames[i] for i in keep), tuple(video.timestamps[i] for i in keep),
                         video.fps, video.duration_s, video.total_frames, video.size, video.source)
    if isinstance(video, (list, tuple)):
        if not video or not all(isinstance(f, Image.Image) for f in video):
            raise EngineError("a video given as frames must be a non-empty list of PIL images")
        keep = sample_indices(len(video), frames)
        picked = [_rgb(video[i]) for i in keep]
        return VideoClip(tuple(picked), tuple(float(i) for i in keep), 1.0, float(len(video)), len(video),
                         picked[0].size, "frames")
    if not isinstance(video, (str, Path)):
        raise EngineError(f"video must be a file path, a list of PIL images or None, got {type(video).__name__}")
    roots = None if allowed_roots is None else [allowed_roots] if isinstance(allowed_roots, (str, Path)) \
        else list(allowed_roots)
    with _open_file(video, roots, MAX_VIDEO_BYTES if max_bytes is None else max_bytes) as fh:
        return _decode_clip(fh, frames, Path(video).name, confined=roots is not None)


def _rgb(image: Image.Image) -> Image.Image:
    image = image.convert("RGB")
    if max(image.size) > MAX_FRAME_SIDE:
        image.thumbnail((MAX_FRAME_SIDE, MAX_FRAME_SIDE))
    return image


def _open_file(path: str | Path, roots: list | None, max_bytes: int):
    """The file, opened for reading, once it is a regular file within `roots` (when given) and `max_bytes`."""
    try:
        fd, info, _ = limits.open_regular_file(path, roots, refused=VIDEO_REFUSED, hint=": pass a video file")
    except limits.LimitError as exc:
        raise EngineError(str(exc)) from None
    if info.st_size > max_bytes:
        os.close(fd)
        raise EngineError(f"the video is {info.st_size / limits.MB:.1f} MB; the limit is "
                          f"{max_bytes / limits.MB:g} MB: send a shorter or smaller clip")
    return os.fdopen(fd, "rb")


def _decode_clip(fh, frames: int, name: str, *, confined: bool) -> VideoClip:
    def refuse(why: str) -> EngineError:
        return EngineError(VIDEO_REFUSED if confined else f"{name} {why}")

    try:
        total, fps = _probe(fh, refuse)
        kept, decoded = _decode(fh, sample_indices(total, frames))
        if decoded != total:  # the header's count was wrong: sample again from what decodes
            kept, decoded = _decode(fh, sample_indices(decoded, frames))
    except (av.FFmpegError, OSError, EOFError):
        raise refuse(f"is not a readable video ({ACCEPTED_VIDEOS}); it may be corrupt or truncated") from None
    if not kept:
        raise refuse("has no frames that decode: it may be corrupt or truncated")
    if fps is None:  # no rate in the header: read it off the frames' own times
        first, last = kept[0], kept[-1]
        fps = (last[0] - first[0]) / (last[1] - first[1]) if last[1] > first[1] else 1.0
    images = tuple(image for _, _, image in kept)
    return VideoClip(images, tuple(i / fps for i, _, _ in kept), fps, decoded / fps, decoded, images[0].size, name)


def _probe(fh, refuse) -> tuple[int, float | None]:
    """Checks the first video stream's frame size; returns its frame count (counted from packets when the
    container does not say) and its frame rate (None when unknown)."""
    fh.seek(0)
    with av.open(fh, options={"format_whitelist": DEMUXERS}) as container:
        if not container.streams.video:
            raise refuse("has no video stream (audio only?): pass a video file")
        stream = container.streams.video[0]
        w, h = stream.codec_context.width, stream.codec_context.height
        if w * h > MAX_VIDEO_PIXELS:
            raise EngineError(f"the video is {w}×{h} pixels per frame; the limit is "
                              f"{MAX_VIDEO_PIXELS / 1e6:g} megapixels: send a smaller video")
        fps = float(stream.average_rate or stream.guessed_rate or 0) or None
        total = stream.frames
        if total <= 0:
            total = sum(1 for packet in container.demux(stream) if packet.size)
        return total, fps


def _decode(fh, indices: list[int]) -> tuple[list[tuple[int, float, Image.Image]], int]:
    """Decodes the whole stream in order, keeping only the frames at `indices`, as (index, time stamped in
    the stream or the index, RGB image). Returns them and the number of frames decoded."""
    wanted, kept, n = set(indices), [], 0
    fh.seek(0)
    with av.open(fh, options={"format_whitelist": DEMUXERS}) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            if n in wanted:
                kept.append((n, frame.time if frame.time is not None else float(n), _rgb(frame.to_image())))
            n += 1
    return kept, n


def write_video(frames, path: str | Path, fps: int = 8) -> Path:
    """Encodes PIL images to a video file (H.264 when the bundled FFmpeg has libx264, else MPEG-4 Part 2;
    yuv420p). Odd widths or heights lose their last pixel row or column, as yuv420p needs even sides."""
    frames = [f.convert("RGB") for f in frames]
    if not frames:
        raise EngineError("write_video needs at least one frame")
    w, h = (s - s % 2 for s in frames[0].size)
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(os.fspath(path), "w") as container:
        stream = container.add_stream(codec, rate=fps, options={"crf": "12"} if codec == "libx264" else {})
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if codec == "mpeg4":
            stream.bit_rate = 4_000_000
        for image in frames:
            frame = av.VideoFrame.from_image(image.crop((0, 0, w, h)) if image.size != (w, h) else image)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return Path(path)
