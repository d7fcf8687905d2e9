"""Seeded clips of moving shapes, and a question that needs the clip's frames over time.

``video_sample(seed)`` draws a clip (16 frames by default, 4 per second) on a plain background tone of the
scenes: 1-3 shapes, drawn exactly as in the scenes (same shapes, colours and the two sizes), each moving in a
straight line across the frame, all along one axis (left/right or up/down) in their own row or column, so they
never overlap. Sometimes (always for ``appears_last``) one of them appears only in the later part of the clip
(from 45-65% of its length on) and crosses the frame in the time left. Colours and shapes are distinct within a
clip. One of three kinds of question (``VIDEO_SUBTASKS``), rotating with the seed's index in its split:

- ``colour_seen``: "What colour is the moving shape?" (one shape) or "What colour is the moving star?" -> "red";
- ``direction``: "Which way does the red star move?" -> "left" / "right" / "up" / "down";
- ``appears_last``: "What shape appears last?" -> "star".

A clip's content is a function of its seed alone; the number of frames only sets how finely the same motion is
sampled (frame i is at time i / (frames - 1) of the clip). Clip seeds lie in ``scenes.splits.SPLITS``' ranges
like the scenes' (``video_samples(split, n)``). ``write_clip`` encodes a clip to mp4 with PyAV;
``cached_clip(seed, frames)`` writes it once under the system temp dir and reuses it.
"""
from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from PIL import Image, ImageDraw

from .drawing import draw_object
from .multi import split_of, splitmix64, subtask_of
from .records import SceneObject
from .render import _SIZE_RADIUS, _SUPERSAMPLE, _contrast
from .splits import SPLITS
from .vocabulary import BACKGROUNDS, COLOURS, MIN_CONTRAST, REGIONS, SHAPES

VIDEO_SUBTASKS = ("colour_seen", "direction", "appears_last")
DIRECTIONS = ("left", "right", "up", "down")
FPS = 4
MIN_FRAMES = 4
_LATE = (0.45, 0.65)  # when a late shape appears, as a fraction of the clip


@dataclass(frozen=True)
class Mover:
    shape: str
    colour: str
    size: str  # "small" | "large"
    direction: str  # one of DIRECTIONS
    lane: float  # the fixed coordinate (y for left/right, x for up/down), fraction of the side
    start: float  # the moving coordinate at the first frame it is shown, fraction of the side
    end: float  # ... and at the last frame
    appears: float = 0.0  # when it first shows, fraction of the clip (0: from the first frame)

    def at(self, t: float) -> tuple[float, float] | None:
        """Centre (x, y) at time ``t`` (0..1), None before it appears."""
        if t < self.appears:
            return None
        u = (t - self.appears) / (1.0 - self.appears)
        p = self.start + (self.end - self.start) * u
        return (p, self.lane) if self.direction in ("left", "right") else (self.lane, p)


@dataclass(frozen=True)
class VideoSample:
    seed: int
    split: str
    subtask: str  # one of VIDEO_SUBTASKS
    background: str  # a BACKGROUNDS tone
    movers: tuple[Mover, ...]
    question: str
    answer: str
    fps: int
    n_frames: int
    frames: tuple[Image.Image, ...] = ()

    def record(self) -> dict:
        """A flat record for JSON: the seed and frame count rebuild the clip."""
        return {"id": f"{self.split}-{self.seed}", "seed": self.seed, "question": self.question,
                "answer": self.answer, "subtask": self.subtask, "frames": self.n_frames, "fps": self.fps}


def _mover(rng: random.Random, shape: str, colour: str, direction: str, lane: int, appears: float) -> Mover:
    size = rng.choice(["small", "large"])
    a, b = rng.uniform(0.14, 0.2), rng.uniform(0.8, 0.86)
    start, end = (a, b) if direction in ("right", "down") else (b, a)
    return Mover(shape=shape, colour=colour, size=size, direction=direction,
                 lane=(lane + 0.5 + rng.uniform(-0.08, 0.08)) / 3.0, start=start, end=end, appears=appears)


def _plan(seed: int):
    """(split, subtask, background, movers, question, answer) for ``seed``."""
    split = split_of(seed)
    subtask = subtask_of(seed, VIDEO_SUBTASKS)
    rng = random.Random(splitmix64(seed ^ 0x766964656F))
    background = rng.choice(sorted(BACKGROUNDS))
    allowed = [c for c, rgb in COLOURS.items() if _contrast(rgb, BACKGROUNDS[background]) >= MIN_CONTRAST]
    n = rng.randint(2, 3) if subtask == "appears_last" else rng.randint(1, 3)
    late = subtask == "appears_last" or (n >= 2 and rng.random() < 0.3)
    target_dir = rng.choice(DIRECTIONS)  # the asked-about mover's direction (all movers share its axis)
    axis = ("left", "right") if target_dir in ("left", "right") else ("up", "down")
    shapes, colours, lanes = rng.sample(SHAPES, n), rng.sample(allowed, n), rng.sample(range(3), n)
    target = n - 1 if subtask == "appears_last" else rng.randrange(n)
    movers = []
    for i in range(n):
        direction = target_dir if i == target else rng.choice(axis)
        appears = rng.uniform(*_LATE) if late and i == n - 1 else 0.0
        movers.append(_mover(rng, shapes[i], colours[i], direction, lanes[i], appears))
    m = movers[target]
    if subtask == "colour_seen":
        what = "shape" if n == 1 else m.shape
        question, answer = f"What colour is the moving {what}?", m.colour
    elif subtask == "direction":
        question, answer = f"Which way does the {m.colour} {m.shape} move?", m.direction
    else:
        question, answer = "What shape appears last?", m.shape
    return split, subtask, background, tuple(movers), question, answer


def _region(x: float, y: float) -> str:
    return REGIONS[min(int(y * 3), 2) * 3 + min(int(x * 3), 2)]


def draw_frame(background: str, movers: tuple[Mover, ...], t: float, size: int) -> Image.Image:
    """The clip at time ``t`` (0..1), ``size`` x ``size`` pixels, drawn as the scenes are (2x, then downsampled)."""
    big = size * _SUPERSAMPLE
    img = Image.new("RGB", (big, big), BACKGROUNDS[background])
    draw = ImageDraw.Draw(img)
    for m in movers:
        centre = m.at(t)
        if centre is None:
            continue
        x, y = centre
        draw_object(draw, SceneObject(shape=m.shape, colour=m.colour, size=m.size, cx=x, cy=y,
                                      region=_region(x, y), radius=_SIZE_RADIUS[m.size] / 3.0), big)
    return img.resize((size, size), Image.LANCZOS)


def video_sample(seed: int, frames: int = 16, size: int = 384, fps: int = FPS, draw: bool = True) -> VideoSample:
    """The clip for ``seed`` (deterministic), ``frames`` frames of ``size`` x ``size``. ``draw=False`` skips the
    pixels (the text is the same)."""
    if frames < MIN_FRAMES:
        raise ValueError(f"a clip has at least {MIN_FRAMES} frames, got {frames}")
    split, subtask, background, movers, question, answer = _plan(int(seed))
    pixels = tuple(draw_frame(background, movers, i / (frames - 1), size) for i in range(frames)) if draw else ()
    return VideoSample(seed=int(seed), split=split, subtask=subtask, background=background, movers=movers,
                       question=question, answer=answer, fps=int(fps), n_frames=frames, frames=pixels)


def video_seeds(split: str, n: int, subtask: str | None = None) -> list[int]:
    """The first ``n`` clip seeds of ``split`` (of one subtask when given): index 0, 1, ... of the range."""
    if split not in SPLITS:
        raise KeyError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    start, step = SPLITS[split].start, 1
    if subtask is not None:
        if subtask not in VIDEO_SUBTASKS:
            raise ValueError(f"unknown subtask {subtask!r}; expected one of {VIDEO_SUBTASKS}")
        start, step = start + VIDEO_SUBTASKS.index(subtask), len(VIDEO_SUBTASKS)
    return [start + i * step for i in range(n)]


def video_samples(split: str, n: int, subtask: str | None = None, frames: int = 16, size: int = 384,
                  draw: bool = True) -> Iterator[VideoSample]:
    """The split's first ``n`` clips (of one subtask when given), in seed order."""
    for seed in video_seeds(split, n, subtask):
        yield video_sample(seed, frames, size, draw=draw)


def video_records(split: str, n: int, subtask: str | None = None, frames: int = 16) -> list[dict]:
    """Flat records (``VideoSample.record``) of ``video_samples``, without drawing the frames."""
    return [s.record() for s in video_samples(split, n, subtask, frames, draw=False)]


def clip_codec() -> str:
    """The encoder ``write_clip`` uses: libx264 when the bundled FFmpeg has it, else mpeg4."""
    import av

    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def write_clip(sample: VideoSample, path: str | Path) -> Path:
    """Encode the clip's frames to an mp4 at the sample's fps (H.264 when this FFmpeg has libx264, else MPEG-4
    Part 2; yuv420p)."""
    import av  # only clips need FFmpeg

    if not sample.frames:
        raise ValueError("the sample has no frames (drawn with draw=False)")
    width, height = sample.frames[0].size
    path = Path(path)
    codec = clip_codec()
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream(codec, rate=sample.fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "23"}
        else:
            stream.bit_rate = 800_000
        for image in sample.frames:
            for packet in stream.encode(av.VideoFrame.from_image(image)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def clip_cache_dir() -> Path:
    """Where ``cached_clip`` keeps clips: a folder under the system temp dir."""
    return Path(tempfile.gettempdir()) / "scene_video_clips"


def cached_clip(seed: int, frames: int = 16, folder: str | Path | None = None) -> Path:
    """The mp4 of clip ``seed`` with ``frames`` frames (default size and fps), written on first use into
    ``folder`` (default ``clip_cache_dir()``) as ``clip-<seed>-<frames>f.mp4`` and reused after (written to a
    temporary name, then renamed, so a reader never sees half a file)."""
    folder = Path(folder) if folder is not None else clip_cache_dir()
    path = folder / f"clip-{int(seed)}-{int(frames)}f.mp4"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{path.name}.{os.getpid()}.tmp"
        write_clip(video_sample(seed, frames), tmp)
        os.replace(tmp, path)
    return path
