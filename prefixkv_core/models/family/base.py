"""What a family module declares.

A family module (`models/family/<name>.py`) holds one or more `Family` records in `FAMILIES` and the functions that
say what differs between families; `models.families` collects every module named in `FAMILY_MODULES` and hands
each family's module to the places that ask (loading, the processor, the prompt's layout, positions). A module
defines:

- ``FAMILIES``: its `Family` records;
- ``family_of(config) -> str | None``: the key of the family a checkpoint's config belongs to, None if not one of
  its own;
- ``config(family, tiny, **ids)``: the config of a model built in code (the released shape, or the tiny test one);
- ``tiny_parts(family, seed) -> (model, processor)`` and ``save_tiny(path, family, seed)``;
- ``load_processor(src, config, **kw)``: a checkpoint's processor (where transformers cannot build all of it);
- ``chat_template(family)``;
- ``image_layout(config, processor, width, height)``, ``max_image_tokens(config, processor)`` and
  ``crop_patches(config, width, height)``: where each image token comes from (the overlay's grid) and which
  tower patches feed it;
- ``image_placeholder(processor)``: the text that stands for one image before the processor expands it, and
  ``image_marker(processor)``: what a user's `<image>` marker becomes in the rendered prompt;
- ``rope_index(model, ids, vision_inputs)``: the 3-D positions of a prompt and its rope delta, for the families
  whose rotary positions are not one number per token (None elsewhere);
- ``tower_shared(config)``: whether the first turn's image may go through the tower once for every prefill and be
  fed as input embeddings (False where the model adds more than the embeddings, e.g. Qwen3-VL's DeepStack
  features: its prefills then read the pixels).

Optional (absent: none): ``image_wrap_tokens(processor) -> int``, the text tokens the processor adds around each
image's tokens (InternVL's `<img>` and `</img>`), which the run limits count; ``pixel_shuffled(config) -> bool``, whether the projector reads the tower's patches
pixel-shuffled (InternVL: the vision-side reductions then read the tower per image token,
`decoding.internvl_vision`).

Plain Python here: a family module imports the rest of the package inside its functions, so the registry can be
built while `models` is being imported."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    key: str
    label: str
    model_type: str
    model_class: str  # the transformers class that loads it
    example: str  # one released checkpoint
    vision: str
    text: str
    anyres: bool  # a variable number of image tokens per image (anyres tiles, or a dynamic resolution)
    tokenizer: str  # the tiny models' tokenizer kind: "llama" (BOS added), "qwen" (ChatML), "qwen-vl"
    module: str = "llava"  # the module under models/family/ that declares what differs
    mrope: bool = False  # 3-D rotary positions (t, h, w): kept per entry through eviction, decoding at pos + delta
    # how many tokens an image takes follows its size (anyres tiles, a native resolution): a smaller image is
    # fewer tokens, so a control that shrinks the image (Downsample) resizes it; a fixed-resolution tower cannot
    token_count_follows_image_size: bool = False
