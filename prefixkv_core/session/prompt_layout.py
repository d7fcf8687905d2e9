"""Where things are in an encoded prompt: where the user's question starts (the query-agnostic mode compresses
what comes before it first) and where each image token comes from (the overlay's views, one set per image)."""
from __future__ import annotations

import torch
from PIL import Image

from ..errors import EngineError
from ..models import IMAGE_TOKEN, ImageLayout, LoadedModel, encode, join_layouts, strip_layout
from ..models.layout import image_runs
from ..models.video import VIDEO_TOKEN, video_layout


def question_start(loaded: LoadedModel, visuals, text: str, ids: torch.Tensor, is_image: torch.Tensor) -> int:
    """How many of the formatted prompt's tokens (`text`, encoded as `ids` [1, N]) come before the user's
    question: the template's opening, the images and video, any text before the question. The question is the
    prompt, or where the prompt places images or a video with markers, its text after the last marker. It keeps
    its own tokens: the split is where the formatted prompt and its part before the question stop encoding
    alike."""
    prompt = visuals.prompt
    last = max(prompt.rfind(IMAGE_TOKEN) + len(IMAGE_TOKEN) if IMAGE_TOKEN in prompt else 0,
               prompt.rfind(VIDEO_TOKEN) + len(VIDEO_TOKEN) if VIDEO_TOKEN in prompt else 0)
    question = prompt[last:]
    if not question.strip():
        raise EngineError("the query-agnostic mode holds the question back until the images are compressed, but "
                          "this prompt has no text after its last <image> or <video> marker; put the question "
                          "after it")
    at = text.rfind(question)
    if at < 0:
        at = text.rfind(question.strip())
    if at < 0:
        raise EngineError("the chat template changes the question's text, so the query-agnostic mode cannot find "
                          "where the question starts; run without it")
    head = text[:at]
    from ..models.families import hooks

    placeholder = hooks(loaded.family).image_placeholder(loaded.processor)  # what the template writes per image
    before_images = visuals.images[:head.count(placeholder)]
    video = visuals.frames if visuals.frames and VIDEO_TOKEN in head else None
    before = encode(loaded, before_images or None, head, video=video, video_fps=visuals.video_fps,
                    video_times=visuals.video_times)["input_ids"][0].tolist() if at > 0 else []
    full = ids[0].tolist()
    split = 0
    while split < min(len(before), len(full)) and before[split] == full[split]:
        split += 1
    if split == 0 or bool(is_image[0, split:].any()):
        raise EngineError("the query-agnostic mode compresses the images before the question, but in this "
                          "model's prompt the question does not follow them; run without it")
    return split


def _one_layout(loaded: LoadedModel, image: Image.Image) -> ImageLayout | None:
    try:
        return loaded.image_layout(*image.size)
    except ValueError:
        return None


def image_token_layout(loaded: LoadedModel, visuals, ids: torch.Tensor, is_image: torch.Tensor
                       ) -> ImageLayout | None:
    """The layout of a prompt's visual tokens (`ids` [N], `is_image` [N]: every crop and newline token of every
    image, a natively read video's tokens), one set of views per image or frame in prompt order. Where the model's
    layout does not account for exactly the tokens the processor made, each image gets one strip of its tokens
    (told apart by the text between them when there is some), or, failing that, one strip holds them all."""
    images = visuals.images
    n_image = int(is_image.sum())
    if not n_image or not visuals.count:
        return None
    layouts = [_one_layout(loaded, im) for im in images]
    video_id = getattr(loaded, "video_token_id", None)
    if visuals.frames and video_id is not None and all(layout is not None for layout in layouts):
        first = int((ids == video_id).nonzero()[0]) if bool((ids == video_id).any()) else len(ids)
        before, tokens = 0, int((ids[:first] == loaded.image_token_id).sum())
        while before < len(layouts) and tokens >= layouts[before].n_tokens:
            tokens -= layouts[before].n_tokens
            before += 1
        video = video_layout(loaded.model.config, len(visuals.frames), visuals.frames[0].size,
                             processor=loaded.processor)
        layouts = layouts[:before] + [video] + layouts[before:]
    if all(layout is not None for layout in layouts) and sum(layout.n_tokens for layout in layouts) == n_image:
        return join_layouts(layouts)
    pictures = [picture for _, picture in visuals.in_order()]
    runs = [n for _, n in image_runs(is_image)]
    if len(runs) == len(pictures):
        return join_layouts([strip_layout(n, im.size) for n, im in zip(runs, pictures)])
    return strip_layout(n_image, pictures[0].size)
