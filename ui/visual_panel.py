"""The visual inputs of the Compare tab: the image, more images (a gallery) and a video with its frame count, and
their examples: the single images of `assets/images`, the image sets of `assets/multi` and the clips of
`assets/videos` (each with the question of its JSON sidecar as the prompt, when it has one)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr

from prefixkv_core.limits import Limits
from prefixkv_core.session.video_input import DEFAULT_FRAMES, MAX_FRAMES

from .inputs import IMAGE_SUFFIXES, checked_image
from .visual_inputs import checked_gallery, checked_video

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
MULTI_ASSETS = ROOT / "assets" / "multi"
VIDEO_ASSETS = ROOT / "assets" / "videos"
VIDEO_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi")
MULTI_PROMPT = "What do these images have in common, and how do they differ?"
VIDEO_PROMPT = "Describe what happens in this video."
PROMPT_INFO = ("the images, then the video's frames, come before your text; type <image> (one per image) or "
               "<video> to place them yourself")


def _sidecar(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("example sidecar %s is not readable JSON; skipped", path)
        return {}
    return data if isinstance(data, dict) else {}


def _number(path: Path) -> tuple:
    """multi-0-2.png -> ('multi-0', 2): a set's name and the image's place in it."""
    head, _, tail = path.stem.rpartition("-")
    return (head, int(tail)) if head and tail.isdigit() else (path.stem, 0)


def multi_examples(folder: Path = MULTI_ASSETS) -> list[tuple[list[str], str]]:
    """(image paths in order, prompt) per image set: from each JSON sidecar's `images` (and its `prompt`, else its
    `question`); image files no sidecar names are grouped by their name's prefix (`multi-0-1.png`, `multi-0-2.png`,
    ...) with a generic prompt."""
    if not folder.is_dir():
        return []
    sets, named = [], set()
    for sidecar in sorted(folder.glob("*.json")):
        data = _sidecar(sidecar)
        names = data.get("images") if isinstance(data.get("images"), list) else []
        paths = [folder / str(n) for n in names if (folder / str(n)).is_file()]
        if len(paths) >= 2:
            prompt = data.get("prompt") or data.get("question") or MULTI_PROMPT
            sets.append(([str(p) for p in paths], str(prompt)))
            named.update(p.name for p in paths)
    groups: dict[str, list[Path]] = {}
    for path in sorted(folder.iterdir(), key=_number):
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file() and path.name not in named:
            groups.setdefault(_number(path)[0], []).append(path)
    sets += [([str(p) for p in paths], MULTI_PROMPT) for paths in groups.values() if len(paths) >= 2]
    return sets


def video_examples(folder: Path = VIDEO_ASSETS) -> list[tuple[str, str]]:
    """(clip path, prompt) per clip: a JSON sidecar's `file` and `question`; clips without one get a generic
    prompt."""
    if not folder.is_dir():
        return []
    clips, named = [], set()
    for sidecar in sorted(folder.glob("*.json")):
        data = _sidecar(sidecar)
        path = folder / str(data.get("file") or sidecar.with_suffix(".mp4").name)
        if path.suffix.lower() in VIDEO_SUFFIXES and path.is_file():
            clips.append((str(path), str(data.get("question") or data.get("prompt") or VIDEO_PROMPT)))
            named.add(path.name)
    clips += [(str(p), VIDEO_PROMPT) for p in sorted(folder.iterdir())
              if p.suffix.lower() in VIDEO_SUFFIXES and p.is_file() and p.name not in named]
    return clips


def visual_inputs(page: SimpleNamespace, limits: Limits, roots, examples: list[str]) -> None:
    """The image, its examples, more images and a video (page.image, page.images, page.video, page.frames), and the
    examples of several images and of a video, which also set `page.prompt` (built before, rendered elsewhere)."""
    page.image = checked_image(limits, roots, label="Image", height=300, sources=["upload", "clipboard"],
                               elem_id="image-input")
    page.image_examples = None
    if examples:
        page.image_examples = gr.Examples(examples=[[p] for p in examples], inputs=[page.image],
                                          label="Example images", examples_per_page=12)
    with gr.Row(equal_height=False):
        page.images = checked_gallery(limits, roots, label="More images (after the image, in order)",
                                      columns=3, height=220, object_fit="contain", elem_id="images-input",
                                      sources=["upload", "clipboard"])
        with gr.Column(min_width=200):
            page.video = checked_video(limits, roots, label="Video (its frames follow the images)",
                                       height=220, elem_id="video-input")
            page.frames = gr.Slider(1, MAX_FRAMES, value=DEFAULT_FRAMES, step=1, label="Frames",
                                    info="sampled evenly over the whole video; each is read as an image",
                                    visible=False, elem_id="frames")
    rows = [[None, paths, None, prompt] for paths, prompt in multi_examples()]  # page.prompt: built, rendered later
    rows += [[None, None, path, prompt] for path, prompt in video_examples()]
    page.visual_examples = None
    if rows:
        page.visual_examples = gr.Examples(examples=rows, inputs=[page.image, page.images, page.video, page.prompt],
                                           label="Several images · a video clip", examples_per_page=6)


def wire_visual_inputs(page: SimpleNamespace) -> None:
    """The Frames slider shows while a video is chosen; an example starts afresh (an example image clears the
    other images and the video, an example set or clip the image)."""
    page.video.change(lambda video: gr.update(visible=video is not None), [page.video], [page.frames],
                      preprocess=False, queue=False, api_visibility="private")
    if page.image_examples is not None:
        page.image_examples.dataset.click(lambda: (None, None), None, [page.images, page.video], queue=False,
                                          api_visibility="private")
    if page.visual_examples is not None:  # gradio leaves out the image's column, empty in every row: clear it here
        page.visual_examples.dataset.click(lambda: None, None, [page.image], queue=False, api_visibility="private")
