"""Where things are in an encoded prompt: where the user's question starts (the query-agnostic mode compresses
what comes before it first) and where each image token comes from (the overlay's views)."""
from __future__ import annotations

import torch
from PIL import Image

from ..errors import EngineError
from ..models import ImageLayout, LoadedModel, encode, strip_layout


def question_start(loaded: LoadedModel, image: Image.Image | None, prompt: str, text: str, ids: torch.Tensor,
                   is_image: torch.Tensor) -> int:
    """How many of the formatted prompt's tokens (`text`, encoded as `ids` [1, N]) come before the user's
    `prompt`: the template's opening, the image, any text before the question. The prompt keeps its own
    tokens: the split is where the formatted prompt and its part before the question stop encoding alike."""
    at = text.rfind(prompt)
    if at < 0:
        at = text.rfind(prompt.strip())
    if at < 0:
        raise EngineError("the chat template changes the question's text, so the query-agnostic mode cannot find "
                          "where the question starts; run without it")
    before = encode(loaded, image, text[:at])["input_ids"][0].tolist() if at > 0 else []
    full = ids[0].tolist()
    split = 0
    while split < min(len(before), len(full)) and before[split] == full[split]:
        split += 1
    if split == 0 or bool(is_image[0, split:].any()):
        raise EngineError("the query-agnostic mode compresses the image before the question, but in this "
                          "model's prompt the question does not follow the image; run without it")
    return split


def image_token_layout(loaded: LoadedModel, image: Image.Image | None, n_image: int) -> ImageLayout | None:
    """The layout of a prompt's `n_image` image tokens (all crops and newline tokens); one strip over the image
    if the model's layout does not account for exactly the tokens the processor made."""
    if not n_image or image is None:
        return None
    size = image.size
    try:
        layout = loaded.image_layout(*size)
    except ValueError:
        layout = None
    return layout if layout is not None and layout.n_tokens == n_image else strip_layout(n_image, size)
