"""Seeded synthetic scenes with known content, for quality checks without a data set.

``render_scene(seed)`` draws 1-5 coloured shapes on a plain, two-tone or gradient
background, sometimes (about 40%) with a short printed word, and returns the
image together with a ground-truth description and question/answer pairs.
The same seed always gives the same pixels and the same text (Pillow only; no
torch, no font files: the text uses Pillow's bundled default font).

Layout: the image is a 3 x 3 grid of regions ("top-left", "top", "top-right",
"left", "centre", "right", "bottom-left", "bottom", "bottom-right"). Each object
sits in its own cell (jittered inside it), so objects never overlap and every
object has exactly one region. A word takes a whole top or bottom row. Within a
scene colours are distinct, so "the red object" and "a red circle" are always
unambiguous; shapes may repeat (so "how many circles?" can be 2 or 3).
Objects are large enough to read at 192 x 192 (small ones are ~28 px across
there, large ones ~49 px, words ~23 px tall).

Answers are short and canonical: a colour name ("red"), a shape name
("circle"), a digit ("3"), a region name ("top-left"), "a blue circle", the
word as printed ("STOP"), "yes" / "no".

Longer inputs, for KV caches that grow with the input (answers graded the same way):

- ``multi_sample(seed)`` (``multi``): 2-6 scenes of one split and one question over them, MileBench-like:
  ``which`` ("Which image shows a red circle?" -> "2"), ``colour_k`` ("What colour is the circle in image 3?"),
  ``needle`` ("Which word is printed in one of the images?" -> "STOP"), ``count`` ("How many circles are there
  in all the images?" -> "4"). ``multi_samples(split, n)`` / ``multi_records``: a split's samples.
- ``video_sample(seed)`` (``video``): a clip of 1-3 shapes moving across a plain background, Video-MME-like:
  ``colour_seen`` ("What colour is the moving star?"), ``direction`` ("Which way does the red star move?" ->
  "left"), ``appears_last`` ("What shape appears last?" -> "star"). ``video_samples(split, n)`` /
  ``video_records``: a split's clips; ``write_clip`` encodes one to mp4 (PyAV).

Modules: ``vocabulary`` (shapes, colours, regions, words), ``records`` (Scene, SceneObject, QA), ``drawing``,
``render`` (``render_scene``), ``questions`` (the question templates), ``splits`` (seed ranges, flat records),
``grading`` (``is_correct``: how an answer is graded), ``multi`` (multi-image samples), ``video`` (clips).
"""
from .multi import MULTI_SUBTASKS, MultiSample, multi_records, multi_sample, multi_samples
from .questions import all_qa
from .records import QA, Scene, SceneObject
from .render import render_scene
from .splits import SPLITS, scene_samples, split_seeds
from .video import VIDEO_SUBTASKS, VideoSample, video_records, video_sample, video_samples, write_clip
from .vocabulary import BACKGROUNDS, COLOURS, PLURALS, QTYPES, REGION_PHRASES, REGIONS, SHAPES, WORDS

__all__ = [
    "SHAPES",
    "PLURALS",
    "COLOURS",
    "BACKGROUNDS",
    "REGIONS",
    "REGION_PHRASES",
    "WORDS",
    "QTYPES",
    "SPLITS",
    "SceneObject",
    "QA",
    "Scene",
    "render_scene",
    "all_qa",
    "split_seeds",
    "scene_samples",
    "MULTI_SUBTASKS",
    "MultiSample",
    "multi_sample",
    "multi_samples",
    "multi_records",
    "VIDEO_SUBTASKS",
    "VideoSample",
    "video_sample",
    "video_samples",
    "video_records",
    "write_clip",
]
