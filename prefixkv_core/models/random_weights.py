"""Randomly initialised LLaVA models with exact released shapes: speed and memory do not depend on the weight
values, so a benchmark can measure LLaVA-1.5-7B/13B without downloading them."""
from __future__ import annotations

import torch

from .configs import random_config
from .descriptor import LoadedModel, image_grid


def build_random_model(kind: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       seed: int = 0) -> LoadedModel:
    """A randomly initialised LLaVA with the shapes of `kind` (see `configs.RANDOM_CONFIGS`), created directly
    on `device` in `dtype` (no CPU copy, no float32 detour: a 7B model is built on the GPU in bf16 in seconds).
    It has no processor: prompts for it are token ids."""
    from transformers import LlavaForConditionalGeneration

    config = random_config(kind)
    device = torch.device(device)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlavaForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.requires_grad_(False)
    text = config.get_text_config()
    n_img = int(config.image_seq_length)
    return LoadedModel(
        model=model, processor=None, name=f"random-{kind}", slug=f"random-{kind}", device=device, dtype=dtype,
        image_token_id=int(config.image_token_id), image_seq_length=n_img, image_grid=image_grid(config, n_img),
        image_size=int(config.vision_config.image_size), vocab_size=int(text.vocab_size),
        bos_id=int(text.bos_token_id if text.bos_token_id is not None else 1),
        max_context=int(getattr(text, "max_position_embeddings", 0) or 0), vision_trained=False,
        random_weights=True,
        notes=[f"randomly initialised weights with the shapes of {kind}: speed and memory only, outputs are noise"])
