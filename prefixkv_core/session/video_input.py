"""The video a comparison is asked about: a file, or frames already decoded, sampled to a few RGB frames.

The engine decodes video itself with PyAV (which brings its own FFmpeg) and hands the sampled PIL frames to
each family's image processor. transformers' video processors need torchvision, and PyPI's torchvision does
not match the CPU torch wheel on these machines, so they are not used.

Sampling: `frames` indices spread over the whole stream, `np.linspace(0, total - 1, frames, dtype=int)`, as
lmms-eval and transformers sample; a stream with fewer frames than asked gives every frame once (`describe()`
then shows frames == total_frames). Frame i is stamped i / fps seconds (fps: the stream's average rate, as
lmms-eval stamps its frames; AVI stores no presentation times worth trusting). The frames are counted from the
stream's packets, read without decoding (the header's count is not trusted). Each sampled frame is reached by
seeking to the keyframe before it and decoding from there, so the decoder's work grows with the frames asked, not
with the frames in the file; a stream without presentation times is decoded in order up to its last sampled frame.

What decoding may cost is bounded (`DecodeBounds`): every decoded frame's size, not only the header's (a file can
state 64 x 64 and hold 6000 x 6000 frames), the sampled frames' pixels together, and the frames and seconds the
decoder goes through; the work needed is read off the packets before a frame is decoded, and metered as it goes.
Frames of a stream that changes size midway are brought to the first sampled frame's size.

Paths follow image_input's rules: a server passes `allowed_roots`, and a file outside them, missing, a
folder, or not a video is refused with VIDEO_REFUSED, which says nothing about the disk; a local caller
gets precise messages. Only the MP4/MOV, Matroska/WebM and AVI demuxers are allowed, so FFmpeg never
follows playlists or other files named inside a file.
"""
from __future__ import annotations

import numbers
import os
import time
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
MAX_VIDEO_PIXELS = 4096 * 4096  # per frame: from the header before decoding, and every frame as it decodes
UNTIMED_FORMATS = ("avi",)  # its packets' times are decode order: frames with B-frames come out with others' times
MAX_STREAM_FRAMES = 200_000  # about two hours at 30 fps: a longer stream is refused before its packets are all read
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
    decoded_frames: int = 0  # frames the decoder went through to reach the sampled ones (0: not read from a file)

    def describe(self) -> dict:
        return {"source": self.source, "frames": len(self.frames), "total_frames": self.total_frames,
                "fps": round(self.fps, 3), "duration_s": round(self.duration_s, 3), "size": list(self.size),
                "timestamps": [round(t, 3) for t in self.timestamps], "decoded_frames": self.decoded_frames}


@dataclass(frozen=True)
class DecodeBounds:
    """What one clip may cost the decoder. `frame_pixels`: every decoded frame (not only the header's size, which a
    hostile file can state small); `clip_pixels`: the sampled frames together (None: no bound); `decode_pixels` and
    `decode_s`: the frames the decoder goes through to reach the sampled ones, in pixels and seconds (None: none).
    The pixels are checked from the stream's packets before anything is decoded, and again as frames decode."""

    frame_pixels: int | None = None  # None: MAX_VIDEO_PIXELS
    clip_pixels: int | None = None
    decode_pixels: int | None = None
    decode_s: float | None = None

    @property
    def frame_limit(self) -> int:
        return MAX_VIDEO_PIXELS if self.frame_pixels is None else self.frame_pixels


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
               max_bytes: int | None = None, bounds: DecodeBounds | None = None) -> VideoClip | None:
    """None, a path, a VideoClip or a list of PIL frames -> a VideoClip of `frames` frames (fewer when the
    video has fewer). A VideoClip with more frames than asked is sampled again from its own frames; a list of
    frames has no known rate, so it is taken as 1 fps. `max_bytes` (default MAX_VIDEO_BYTES) bounds the file
    before it is opened; `bounds` (default: MAX_VIDEO_PIXELS a frame, nothing else) what decoding it may cost.
    Raises EngineError."""
    frames = check_frames(frames)
    if video is None:
        return None
    if isinstance(video, VideoClip):
        keep = sample_indices(len(video.frames), frames)
        return VideoClip(tuple(video.frames[i] for i in keep), tuple(video.timestamps[i] for i in keep),
                         video.fps, video.duration_s, video.total_frames, video.size, video.source,
                         video.decoded_frames)
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
        return _decode_clip(fh, frames, Path(video).name, confined=roots is not None, bounds=bounds or DecodeBounds())


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


def _decode_clip(fh, frames: int, name: str, *, confined: bool, bounds: DecodeBounds) -> VideoClip:
    def refuse(why: str) -> EngineError:
        return EngineError(VIDEO_REFUSED if confined else f"{name} {why}")

    try:
        fh.seek(0)
        with av.open(fh, options={"format_whitelist": DEMUXERS}) as container:
            stream, fps = _probe(container, refuse, bounds)
            packets = _index(container, stream)
            wanted = sample_indices(len(packets), frames)
            plan = _plan(packets, wanted, timed=container.format.name not in UNTIMED_FORMATS)
            _check_decode_cost(plan, stream, bounds)
            kept, reached, decoded = _decode(container, stream, plan, bounds)
    except (av.FFmpegError, OSError, EOFError):
        raise refuse(f"is not a readable video ({ACCEPTED_VIDEOS}); it may be corrupt or truncated") from None
    if not kept:
        raise refuse("has no frames that decode: it may be corrupt or truncated")
    total = max(len(packets), reached)
    if fps is None:  # no rate in the header: read it off the frames' own times
        first, last = kept[0], kept[-1]
        fps = (last[0] - first[0]) / (last[1] - first[1]) if last[1] > first[1] else 1.0
    images = _one_size([image for _, _, image in kept])
    return VideoClip(images, tuple(i / fps for i, _, _ in kept), fps, total / fps, total, images[0].size, name,
                     decoded_frames=decoded)


def _probe(container, refuse, bounds: DecodeBounds):
    """The first video stream, once its header's frame size and length are within bounds, and its frame rate
    (None when unknown)."""
    if not container.streams.video:
        raise refuse("has no video stream (audio only?): pass a video file")
    stream = container.streams.video[0]
    w, h = stream.codec_context.width, stream.codec_context.height
    if w * h > bounds.frame_limit:
        raise EngineError(f"the video is {w}×{h} pixels per frame; the limit is {bounds.frame_limit / 1e6:g} "
                          "megapixels: send a smaller video")
    if stream.frames > MAX_STREAM_FRAMES:
        raise _too_long(stream.frames)
    return stream, float(stream.average_rate or stream.guessed_rate or 0) or None


def _too_long(frames: int, more: bool = False) -> EngineError:
    return EngineError(f"the video has {'more than ' if more else ''}{frames:,} frames; the limit is "
                       f"{MAX_STREAM_FRAMES:,}: send a shorter clip")


@dataclass(frozen=True)
class _Packet:
    pts: int | None
    key: bool
    decode_at: int  # its place in decode order


def _index(container, stream) -> list[_Packet]:
    """The stream's frames in presentation order, read from its packets without decoding any (at most
    MAX_STREAM_FRAMES of them: a container that states no count is read that far and no further)."""
    packets = []
    for packet in container.demux(stream):
        if not packet.size:
            continue
        if len(packets) == MAX_STREAM_FRAMES:
            raise _too_long(len(packets), more=True)
        packets.append(_Packet(packet.pts, bool(packet.is_keyframe), len(packets)))
    if all(p.pts is not None for p in packets):
        packets.sort(key=lambda p: p.pts)
    return packets


@dataclass(frozen=True)
class _Step:
    """Seek to `seek_pts` (None: go on decoding from where the last step stopped), then take the frame at
    presentation position `index` (time `pts`); `decodes`: the frames decoded to reach it."""

    seek_pts: int | None
    index: int
    pts: int
    decodes: int


@dataclass(frozen=True)
class _Plan:
    seekable: bool
    steps: tuple[_Step, ...] = ()
    wanted: tuple[int, ...] = ()  # without timestamps: the positions to keep, decoding from the start

    @property
    def frames(self) -> int:
        """The sampled frames it reaches."""
        return len(self.steps) if self.seekable else len(self.wanted)

    @property
    def decodes(self) -> int:
        """The frames it decodes to reach them."""
        return sum(step.decodes for step in self.steps) if self.seekable else self.wanted[-1] + 1


def _plan(packets: list[_Packet], wanted: list[int], timed: bool = True) -> _Plan:
    """How to reach the sampled frames. With presentation times, each one from the keyframe before it in decode
    order, seeking only when that keyframe lies ahead of the frame taken last (so neighbouring samples in one
    group of pictures are decoded once); without them (or in a container whose times are not to be trusted,
    `timed=False`, unless every frame is a keyframe), decoding in order up to the last sampled frame."""
    if not wanted:
        return _Plan(seekable=True)
    if any(p.pts is None for p in packets) or not (timed or all(p.key for p in packets)):
        return _Plan(seekable=False, wanted=tuple(wanted))
    by_decode = sorted(packets, key=lambda p: p.decode_at)
    last_key, keys = 0, []
    for p in by_decode:  # for every packet, the latest keyframe at or before it in decode order
        if p.key:
            last_key = p.decode_at
        keys.append(last_key)
    steps, reached = [], -1  # reached: the decode position of the last packet fed so far
    for index in wanted:
        target = packets[index]
        key = keys[target.decode_at]
        seek = by_decode[key].pts if key > reached else None
        start = key if seek is not None else reached + 1
        steps.append(_Step(seek, index, target.pts, max(target.decode_at - start + 1, 0)))
        reached = max(reached, target.decode_at) if seek is None else target.decode_at
    return _Plan(seekable=True, steps=tuple(steps))


def _check_decode_cost(plan: _Plan, stream, bounds: DecodeBounds) -> None:
    """Refuses, before decoding, a clip whose sampled frames lie behind more decoding than the bounds allow (a long
    stream with few keyframes)."""
    if bounds.decode_pixels is None:
        return
    pixels = plan.decodes * stream.codec_context.width * stream.codec_context.height
    if pixels > bounds.decode_pixels:
        raise _over_decode(plan.frames, plan.decodes, pixels, bounds)


def _over_decode(n_frames: int, decodes: int, pixels: int, bounds: DecodeBounds) -> EngineError:
    return EngineError(f"reaching {n_frames} sampled frame{'s' if n_frames != 1 else ''} means decoding {decodes:,} "
                       f"frames of this video ({pixels / 1e9:.1f} gigapixels; its keyframes are far apart); the limit "
                       f"is {bounds.decode_pixels / 1e9:g} gigapixels: ask for fewer frames, or send a shorter clip or "
                       "one with more keyframes")


class _Meter:
    """Every decoded frame counted against the bounds as it comes: its own size, the pixels and seconds the decoder
    has spent, and the sampled frames' pixels together."""

    def __init__(self, bounds: DecodeBounds, n_frames: int, header_size: tuple[int, int]):
        self.bounds, self.n_frames, self.header_size = bounds, n_frames, header_size
        self.decoded = self.pixels = self.kept_pixels = 0
        self.deadline = None if bounds.decode_s is None else time.monotonic() + bounds.decode_s

    def decoded_frame(self, frame) -> None:
        w, h = frame.width, frame.height
        if w * h > self.bounds.frame_limit:
            raise EngineError(f"a frame of the video is {w}×{h} pixels (its header says {self.header_size[0]}×"
                              f"{self.header_size[1]}); the limit is {self.bounds.frame_limit / 1e6:g} megapixels "
                              "a frame: send a smaller video")
        self.decoded += 1
        self.pixels += w * h
        if self.bounds.decode_pixels is not None and self.pixels > self.bounds.decode_pixels:
            raise _over_decode(self.n_frames, self.decoded, self.pixels, self.bounds)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise EngineError(f"decoding the video took more than {self.bounds.decode_s:g} s and was stopped: ask "
                              "for fewer frames or send a shorter or smaller clip")

    def kept_frame(self, frame) -> None:
        self.kept_pixels += frame.width * frame.height
        limit = self.bounds.clip_pixels
        if limit is not None and self.kept_pixels > limit:
            raise EngineError(f"the {self.n_frames} sampled frames hold more than {limit / 1e6:g} megapixels (frames "
                              f"of {frame.width}×{frame.height} pixels, larger than the video's header says): ask for "
                              "fewer frames or send a smaller video")


def _decode(container, stream, plan: _Plan, bounds: DecodeBounds):
    """The sampled frames as (presentation position, time stamped in the stream or the position, RGB image), and
    how far into the stream decoding reached (frames). Every frame decoded is metered, kept or not."""
    stream.thread_type = "AUTO"
    meter = _Meter(bounds, plan.frames, (stream.codec_context.width, stream.codec_context.height))
    kept = []

    def keep(index, frame):
        meter.kept_frame(frame)
        kept.append((index, frame.time if frame.time is not None else float(index), _rgb(frame.to_image())))

    if not plan.seekable:  # no timestamps: in order from the start, as far as the last sampled frame
        wanted, n = set(plan.wanted), 0
        container.seek(0)
        for frame in container.decode(stream):
            meter.decoded_frame(frame)
            if n in wanted:
                keep(n, frame)
            n += 1
            if n > plan.wanted[-1]:
                break
        return kept, n, meter.decoded
    frames_in = None
    for step in plan.steps:  # the first step always seeks
        if step.seek_pts is not None:
            container.seek(step.seek_pts, stream=stream, backward=True, any_frame=False)
            frames_in = container.decode(stream)
        for frame in frames_in:
            meter.decoded_frame(frame)
            if frame.pts is not None and frame.pts >= step.pts:  # the sampled frame (or the next that decodes)
                keep(step.index, frame)
                break
    return kept, 0, meter.decoded


def _one_size(images: list[Image.Image]) -> tuple[Image.Image, ...]:
    """The sampled frames at the first one's size: a stream may change size midway, and a model reads a clip as
    frames of one size (Qwen's temporal patches join two frames)."""
    size = images[0].size
    return tuple(im if im.size == size else im.resize(size, Image.BICUBIC) for im in images)


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
