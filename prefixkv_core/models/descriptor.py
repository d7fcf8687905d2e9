"""What the rest of the project knows about a model: `LoadedModel`, and `describe_model`, which builds one
from a LLaVA model and its processor (checking that they agree on the image tokens). A model with random
weights (`build_random_model`) is a LoadedModel without a processor."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ModelLoadError
from .families import FAMILY_INFO, IMAGE_TOKEN, family_of, hooks
from .layout import ImageLayout, image_layout, max_image_tokens
from .video import reads_video_natively


class TextShape:
    """Shape facts of the language model under `self.model` (a LLaVA), read from its text config."""

    model: Any

    @property
    def text_config(self):
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        cfg = self.text_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.text_config
        hd = getattr(cfg, "head_dim", None)
        return int(hd) if hd else int(cfg.hidden_size // cfg.num_attention_heads)


@dataclass
class LoadedModel(TextShape):
    model: Any  # LlavaForConditionalGeneration, eval mode, on `device`, in `dtype`
    processor: Any  # LlavaProcessor (tokenizer + image processor + chat template); None for random weights
    name: str
    slug: str
    device: torch.device
    dtype: torch.dtype
    image_token_id: int
    image_seq_length: int  # tokens of one image; anyres families: the most one image can take
    image_grid: tuple[int, int]  # (rows, cols) of the (first) view's patch grid
    image_size: int  # the vision tower's input side, in pixels
    vocab_size: int
    bos_id: int  # what a prompt starts with (synthetic prompts use it too)
    max_context: int
    vision_trained: bool
    random_weights: bool = False  # shapes only: speed and memory are real, outputs are noise
    notes: list[str] = field(default_factory=list)
    family: str = "llava-1.5"  # see families.FAMILY_INFO
    video_token_id: int | None = None  # the token of a video read natively (OneVision's video path), else None

    @property
    def anyres(self) -> bool:
        """Whether the number of image tokens depends on the image (LLaVA-NeXT, LLaVA-OneVision)."""
        return FAMILY_INFO[self.family].anyres

    def image_layout(self, width: int, height: int) -> ImageLayout:
        """Where each token of an image of this size comes from (views, patch grids, newline tokens)."""
        return image_layout(self.model.config, self.processor, int(width), int(height))  # the family's own

    def visual_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of `ids` are visual tokens: an image's, or a video's read natively (OneVision)."""
        mask = ids == self.image_token_id
        return mask | (ids == self.video_token_id) if self.video_token_id is not None else mask

    def image_tokens(self, width: int, height: int) -> int:
        """How many tokens an image of this size takes in a prompt."""
        return self.image_layout(width, height).n_tokens

    @property
    def tokenizer(self):
        if self.processor is None:
            raise ModelLoadError(f"{self.name} has no tokenizer (random weights)")
        return self.processor.tokenizer

    def kv_bytes_per_token(self) -> int:
        """Keys + values of one token over all layers, uncompressed, in the model's dtype."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _count_image_tokens(processor, image_token_id: int, size: tuple[int, int] = (64, 48),
                        placeholder: str = IMAGE_TOKEN) -> int:
    from PIL import Image

    img = Image.new("RGB", size, (127, 127, 127))
    ids = processor(images=img, text=placeholder, return_tensors="pt")["input_ids"]
    return int((ids == image_token_id).sum().item())


def _one_side(value):
    """One side of a vision config's image_size (an int, or a (height, width) pair as InternViT's)."""
    return value[0] if isinstance(value, (list, tuple)) else value


def image_grid(config, image_seq_length: int) -> tuple[int, int]:
    """(rows, cols) of the image tokens: the vision tower's patch grid when it matches their number."""
    vc = config.vision_config
    try:
        side = int(vc.image_size) // int(vc.patch_size)
        if side * side in (image_seq_length, image_seq_length - 1):
            return (side, side)
    except (AttributeError, TypeError):
        pass
    r = int(round(math.sqrt(image_seq_length)))
    if r * r == image_seq_length:
        return (r, r)
    return (1, image_seq_length)


def describe_model(
    model,
    processor,
    *,
    name: str,
    slug: str,
    device: torch.device,
    dtype: torch.dtype,
    vision_trained: bool,
    notes: list[str],
) -> LoadedModel:
    """Put `model` in eval mode, check the processor against its config, and describe both."""
    model.eval()
    cfg = model.config
    image_token_id = int(cfg.image_token_id)
    tok = processor.tokenizer
    proc_id = getattr(processor, "image_token_id", None)
    if proc_id is not None and int(proc_id) != image_token_id:
        raise ModelLoadError(
            f"{name}: processor image token id {proc_id} differs from config.image_token_id {image_token_id}"
        )
    family = family_of(cfg)
    n_img = _count_image_tokens(processor, image_token_id, placeholder=hooks(family).image_placeholder(processor))
    layout_n = image_layout(cfg, processor, 64, 48).n_tokens
    if layout_n != n_img:  # the overlay would then place the image tokens in one strip
        notes.append(f"the processor expands <image> into {n_img} tokens where this model's layout has {layout_n}")
    image_size = _one_side(getattr(cfg.vision_config, "image_size", None))
    if FAMILY_INFO[family].mrope:  # a dynamic resolution: the largest square image the processor keeps as it is
        n_img = max_image_tokens(cfg, processor)
        side = int(math.isqrt(n_img))
        grid = (side, side)
        image_size = side * int(cfg.vision_config.patch_size) * int(cfg.vision_config.spatial_merge_size)
    elif FAMILY_INFO[family].anyres:  # the first view of an image of the tower's size (a base view, one tile)
        first = image_layout(cfg, processor, image_size, image_size).views[0]
        grid = (first.rows, first.cols)
        n_img = max_image_tokens(cfg, processor)
    else:
        grid = image_grid(cfg, n_img)
        cfg_len = getattr(cfg, "image_seq_length", None)
        if cfg_len is not None and int(cfg_len) != n_img:
            notes.append(f"config.image_seq_length={cfg_len} but the processor expands <image> into {n_img} tokens")
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None and tok.pad_token_id is not None:
        gen.pad_token_id = tok.pad_token_id
    text_cfg = cfg.get_text_config()
    bos = tok.bos_token_id if tok.bos_token_id is not None else getattr(text_cfg, "bos_token_id", None)
    return LoadedModel(
        model=model,
        processor=processor,
        name=name,
        slug=slug,
        device=device,
        dtype=dtype,
        image_token_id=image_token_id,
        image_seq_length=n_img,
        image_grid=tuple(grid),
        image_size=int(image_size),
        vocab_size=int(text_cfg.vocab_size),
        bos_id=int(bos if bos is not None else 1),
        max_context=int(getattr(text_cfg, "max_position_embeddings", 0) or tok.model_max_length),
        vision_trained=vision_trained,
        notes=notes,
        family=family,
        video_token_id=int(cfg.video_token_id) if reads_video_natively(cfg) else None,
    )
