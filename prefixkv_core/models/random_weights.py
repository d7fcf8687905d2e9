"""Randomly initialised LLaVA models with exact released shapes: speed and memory do not depend on the weight
values, so a benchmark can measure LLaVA-1.5-7B/13B or any family's example checkpoint without downloading it."""
from __future__ import annotations

import torch

from .chat import FAMILY_TEMPLATES, IMAGE_TOKEN
from .configs import RANDOM_FAMILIES, RANDOM_MROPE, random_config
from .descriptor import LoadedModel, describe_model, image_grid
from .device import instantiate
from .families import FAMILY_INFO, model_class
from .processor import family_processor


def build_random_model(kind: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       seed: int = 0) -> LoadedModel:
    """A randomly initialised model with the shapes of `kind` (see `configs.RANDOM_KINDS`), created directly
    on `device` in `dtype` (no CPU copy, no float32 detour: a 7B model is built on the GPU in bf16 in seconds).
    The kinds: LLaVA-1.5-7B/13B, the embedded and the tiny shapes (no processor: prompts for them are token ids);
    a LLaVA family's example checkpoint or its tiny model (`configs.RANDOM_FAMILIES`: LLaVA-1.5, LLaVA-Interleave,
    LLaVA-NeXT, LLaVA-OneVision); and the released shapes the Qwen-VL and InternVL modules build
    (`configs.RANDOM_MROPE`: Qwen2.5-VL-3B-Instruct, InternVL3-1B). Those last two groups come with the family's
    processor on a small stand-in tokenizer, so they also run image prompts through the engine."""
    if kind in RANDOM_FAMILIES:
        return _random_family(kind, torch.device(device), dtype, seed)
    if kind in RANDOM_MROPE:
        return _random_mrope(kind, torch.device(device), dtype, seed)
    from transformers import LlavaForConditionalGeneration

    config = random_config(kind)
    device = torch.device(device)
    model = instantiate(LlavaForConditionalGeneration, config, device, dtype, seed)
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


def _random_family(kind: str, device: torch.device, dtype: torch.dtype, seed: int) -> LoadedModel:
    """A family's shape with random weights and a processor: the family's own image preprocessing and chat
    template on a small byte-level tokenizer of the family's kind (its ids become the model's special ids; a
    released shape keeps its full vocabulary, so the embedding and the output layer cost what they cost)."""
    from .tiny import build_family_tokenizer

    family, tiny = RANDOM_FAMILIES[kind]
    info = FAMILY_INFO[family]
    tok = build_family_tokenizer(info.tokenizer)
    ids = {"image_token_id": tok.convert_tokens_to_ids(IMAGE_TOKEN)}
    if info.tokenizer == "qwen":
        ids["video_token_id"] = tok.convert_tokens_to_ids("<video>")
    if tiny:
        ids.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        if tok.bos_token_id is not None:
            ids["bos_token_id"] = tok.bos_token_id
    config = random_config(kind, **ids)
    model = instantiate(model_class(config), config, device, dtype, seed)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id = tok.pad_token_id, tok.eos_token_id
    if tok.bos_token_id is not None:
        gen.bos_token_id = tok.bos_token_id
    loaded = describe_model(model, family_processor(config, tok, FAMILY_TEMPLATES[family]), name=f"random-{kind}",
                            slug=f"random-{kind}", device=device, dtype=dtype, vision_trained=False,
                            notes=[f"randomly initialised weights with the shapes of {kind} ({info.example}"
                                   f"{' scaled down' if tiny else ''}) and a small stand-in tokenizer: speed and "
                                   f"memory only, outputs are noise"])
    loaded.random_weights = True
    return loaded


def _random_mrope(kind: str, device: torch.device, dtype: torch.dtype, seed: int) -> LoadedModel:
    """A released Qwen-VL or InternVL shape with random weights and a processor (its family module builds both)."""
    from .families import hooks

    family = RANDOM_MROPE[kind]
    model, processor = hooks(family).random_parts(family, device, dtype, seed)
    info = FAMILY_INFO[family]
    loaded = describe_model(model, processor, name=f"random-{kind}", slug=f"random-{kind}", device=device,
                            dtype=dtype, vision_trained=False,
                            notes=[f"randomly initialised weights with the shapes of {kind} ({info.example}) and a "
                                   "small stand-in tokenizer: speed and memory only, outputs are noise"])
    loaded.random_weights = True
    return loaded
