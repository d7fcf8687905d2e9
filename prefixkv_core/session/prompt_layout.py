"""Where things are in an encoded prompt: where the user's question starts (the query-agnostic mode compresses
what comes before it first) and where each image token comes from (the overlay's views, one set per image)."""
from __future__ import annotations

import torch
from PIL import Image

from ..errors import EngineError
from ..models import IMAGE_TOKEN, ImageLayout, LoadedModel, encode, join_layouts, strip_layout


def question_start(loaded: LoadedModel, images: list[Image.Image], prompt: str, text: str, ids: torch.Tensor,
                   is_image: torch.Tensor) -> int:
    """How many of the formatted prompt's tokens (`text`, encoded as `ids` [1, N]) come before the user's
    question: the template's opening, the images, any text before the question. The question is the prompt, or
    where the prompt places images with `<image>` markers, its text after the last marker. It keeps its own
    tokens: the split is where the formatted prompt and its part before the question stop encoding alike."""
    question = prompt.rsplit(IMAGE_TOKEN, 1)[-1] if IMAGE_TOKEN in prompt else prompt
    if not question.strip():
        raise EngineError("the query-agnostic mode holds the question back until the images are compressed, but "
                          "this prompt has no text after its last <image> marker; put the question after it")
    at = text.rfind(question)
    if at < 0:
        at = text.rfind(question.strip())
    if at < 0:
        raise EngineError("the chat template changes the question's text, so the query-agnostic mode cannot find "
                          "where the question starts; run without it")
    before_images = images[:text[:at].count(IMAGE_TOKEN)]
    before = encode(loaded, before_images or None, text[:at])["input_ids"][0].tolist() if at > 0 else []
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


def _runs(is_image: torch.Tensor) -> list[int]:
    """The lengths of the runs of consecutive image tokens in a prompt row [N]."""
    flags = is_image.long().tolist()
    runs, length = [], 0
    for f in flags + [0]:
        if f:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return runs


def image_token_layout(loaded: LoadedModel, images: list[Image.Image], is_image: torch.Tensor) -> ImageLayout | None:
    """The layout of a prompt's image tokens (`is_image` [N]: every crop and newline token of every image), one
    set of views per image in prompt order. Where the model's layout does not account for exactly the tokens the
    processor made, each image gets one strip of its tokens (told apart by the text between them when there is
    some), or, failing that, one strip holds them all."""
    n_image = int(is_image.sum())
    if not n_image or not images:
        return None
    layouts = [_one_layout(loaded, im) for im in images]
    if all(layout is not None for layout in layouts) and sum(layout.n_tokens for layout in layouts) == n_image:
        return join_layouts(layouts)
    runs = _runs(is_image)
    if len(runs) == len(images):
        return join_layouts([strip_layout(n, im.size) for n, im in zip(runs, images)])
    return strip_layout(n_image, images[0].size)
