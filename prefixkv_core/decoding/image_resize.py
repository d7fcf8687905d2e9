"""A smaller image instead of fewer tokens: the prompt re-encoded with its images resized before the vision tower,
for a method that shrinks the image itself (Downsample where the family's token count follows the image size:
the anyres families' tiles, Qwen-VL's native resolution).

Each image is scaled by one factor s on both sides, the largest count of tokens the processor makes for the
scaled image that is not above the image's share of the budget (its share in proportion to its tokens, as for
every vision-side reduction); counts come from the family's layout (`LoadedModel.image_tokens`), the tower is not
run. The resized prompt is then encoded by the processor, so the model reads it by its own path (positions
included: Qwen-VL's 3-D positions come from the resized grid). What each fed token stands for among the original
prompt's image tokens is told by geometry: a resized grid cell covers the original tokens of the same view whose
centres fall in its box (the nearest one when none does).

A video read natively on Qwen2-VL's or Qwen2.5-VL's own path is resized the same way: every frame by one factor,
the video's share of the budget over its tokens (each merged grid covers two frames), its groups' fed tokens told
apart by group."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..policies.reduction import KINDS, ImageTokenSources

SCALE_STEPS = 400  # scales tried between 1 and 1/SCALE_STEPS


def scaled_size(image_tokens, width: int, height: int, wanted: int) -> tuple[int, int]:
    """(width, height) of the image scaled by the s in (0, 1] whose token count `image_tokens(w, h)` is the largest
    not above `wanted` (the larger s on a tie); the smallest count tried when none is that small."""
    best, best_count, low, low_count = (width, height), None, (width, height), None
    for step in range(SCALE_STEPS, 0, -1):
        s = step / SCALE_STEPS
        size = (max(1, round(width * s)), max(1, round(height * s)))
        count = image_tokens(*size)
        if count <= wanted and (best_count is None or count > best_count):
            best, best_count = size, count
        if low_count is None or count < low_count:
            low, low_count = size, count
    return best if best_count is not None else low


def _centres(view) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, token index within the view) of every patch token of a view, in image fractions."""
    r, c = np.divmod(np.arange(view.rows * view.cols), view.cols)
    left, top, right, bottom = view.box
    x = left + (c + 0.5) / view.cols * (right - left)
    y = top + (r + 0.5) / view.rows * (bottom - top)
    return x, y, r * (view.cols + int(view.newline)) + c


def covered_tokens(original, resized) -> list[np.ndarray]:
    """Per token of the resized image's layout (newline tokens included, covering none), the original layout's
    tokens (indices in its block) it covers: those of the view of the same name over the same box (else of the views
    of its kind, whose names share its first word, as InternVL's tiles "tile 1,2" of another grid; else of the views
    over the same box; else of the first) whose centres fall in the resized cell's box."""
    starts = np.cumsum([0] + [v.n_tokens for v in original.views])
    out: list[np.ndarray] = []
    for view in resized.views:
        found = []
        for j in _matching_views(original, view):
            x, y, index = _centres(original.views[j])
            found.append((x, y, index + starts[j]))
        x, y, index = (np.concatenate(part) for part in zip(*found))
        left, top, right, bottom = view.box
        for r in range(view.rows):
            y0, y1 = top + r / view.rows * (bottom - top), top + (r + 1) / view.rows * (bottom - top)
            for c in range(view.cols):
                x0, x1 = left + c / view.cols * (right - left), left + (c + 1) / view.cols * (right - left)
                inside = (x >= x0) & (x < x1) & (y >= y0) & (y < y1)
                if not inside.any():
                    inside = np.zeros_like(inside)
                    inside[np.argmin((x - (x0 + x1) / 2) ** 2 + (y - (y0 + y1) / 2) ** 2)] = True
                out.append(np.sort(index[inside]).astype(np.int64))
            if view.newline:
                out.append(np.zeros(0, dtype=np.int64))
    return out


def _matching_views(original, view) -> list[int]:
    """The original layout's views a resized view's cells are looked up in (see `covered_tokens`)."""
    views = original.views
    same = [i for i, v in enumerate(views) if v.name == view.name and v.box == view.box]
    if same:
        return same[:1]
    for alike in (lambda v: v.name.split()[:1] == view.name.split()[:1], lambda v: v.box == view.box):
        found = [i for i, v in enumerate(views) if alike(v)]
        if found:
            return found
    return [0]


@dataclass
class ResizedPrompt:
    ids: torch.Tensor  # [1, N'] the prompt re-encoded with the resized images
    is_image: torch.Tensor  # [1, N']
    inputs: dict  # the processor's output for it (its image tensors)
    sizes: list[tuple[int, int]]  # every resized image's (width, height)
    record: ImageTokenSources  # what each fed image token stands for among the original prompt's


def resized_prompt(loaded, images: list[Image.Image], text: str, wanted: int, prompt_image_tokens: int,
                   frames: list[Image.Image] | None = None, frames_at: int = 0, video_fps: float | None = None,
                   video_times=None) -> ResizedPrompt | None:
    """The prompt `text` encoded with `images` each scaled so that all of them together take about `wanted` image
    tokens (each its share, in proportion to its tokens); None when no image would be made smaller. `frames`: a
    video read natively on Qwen's own path, after the first `frames_at` images, all its frames scaled alike
    (`video_fps`, `video_times`: its rate and its frames' seconds, as `encode` takes them)."""
    from ..models import encode

    items: list[tuple[str, Image.Image]] = [("image", im) for im in images]
    if frames:
        items.insert(frames_at, ("video", frames[0]))
    token_count = {"image": loaded.image_tokens, "video": _video_tokens(loaded, len(frames or ()))}
    layout_of = {"image": loaded.image_layout, "video": _video_layout(loaded, len(frames or ()))}
    originals = [layout_of[kind](*im.size) for kind, im in items]
    counts = [lay.n_tokens for lay in originals]
    total = sum(counts) or 1
    sizes = []
    for (kind, im), count in zip(items, counts):
        share = wanted if len(items) == 1 else int(round(wanted * count / total))
        sizes.append(scaled_size(token_count[kind], im.size[0], im.size[1], share))
    if all(size == im.size for size, (_, im) in zip(sizes, items)):
        return None
    resized = [im if size == im.size else im.resize(size, Image.BICUBIC)
               for size, (kind, im) in zip(sizes, items) if kind == "image"]
    video = None
    if frames:
        size = sizes[frames_at]
        video = [f if f.size == size else f.resize(size, Image.BICUBIC) for f in frames]
    inputs = encode(loaded, resized or None, text, video=video, video_fps=video_fps, video_times=video_times)
    ids = inputs["input_ids"]
    is_image = loaded.visual_mask(ids)
    layouts = [layout_of[kind](*size) for size, (kind, _) in zip(sizes, items)]
    if int(is_image.sum()) != sum(lay.n_tokens for lay in layouts) or total != prompt_image_tokens:
        raise ValueError("the resized prompt's image tokens do not follow the images' layouts")
    kinds, cells, which, offset, picture = [], [], [], 0, 0
    for orig, lay in zip(originals, layouts):
        covered = covered_tokens(orig, lay)
        cells += [c + offset for c in covered]
        kinds += ["pooled"] * len(covered)
        for view in lay.views:  # an image's views are all its own; a video's are one per group of frames
            which += [picture + view.image] * view.n_tokens
        offset += orig.n_tokens
        picture += lay.n_images
    record = ImageTokenSources(kinds, cells, offset, picture, {k: kinds.count(k) for k in KINDS},
                               is_image[0].nonzero().flatten().cpu().numpy(), np.array(which, dtype=np.int64),
                               list(sizes))
    return ResizedPrompt(ids, is_image, inputs, sizes, record)


def _video_tokens(loaded, n_frames: int):
    """(width, height) of the frames -> the tokens of a native video of `n_frames` such frames."""
    from ..models.video import video_token_count

    return lambda w, h: video_token_count(loaded.model.config, n_frames, (int(w), int(h)), loaded.processor)


def _video_layout(loaded, n_frames: int):
    """(width, height) of the frames -> the layout of a native video of `n_frames` such frames."""
    from ..models.video import video_layout

    return lambda w, h: video_layout(loaded.model.config, n_frames, (int(w), int(h)), processor=loaded.processor)
