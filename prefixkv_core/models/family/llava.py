"""The LLaVA families: LLaVA-1.5 and LLaVA-Interleave (`llava`), LLaVA-NeXT (`llava_next`, anyres) and
LLaVA-OneVision (`llava_onevision`, anyres, a video path of its own). Their configs are in `models.configs`, their
processors in `models.processor`, their chat templates in `models.chat`, their image geometry in `models.layout`;
this module is what the registry reads of them."""
from __future__ import annotations

from .base import Family

FAMILIES = (
    Family("llava-1.5", "LLaVA-1.5", "llava", "LlavaForConditionalGeneration", "llava-hf/llava-1.5-7b-hf",
           "CLIP ViT-L/14-336 (576 tokens)", "Vicuna-1.5 (Llama-2)", False, "llama"),
    Family("llava-interleave", "LLaVA-Interleave", "llava", "LlavaForConditionalGeneration",
           "llava-hf/llava-interleave-qwen-0.5b-hf", "SigLIP so400m/14-384 (729 tokens)", "Qwen1.5", False,
           "qwen"),
    Family("llava-next", "LLaVA-NeXT (1.6)", "llava_next", "LlavaNextForConditionalGeneration",
           "llava-hf/llava-v1.6-mistral-7b-hf", "CLIP ViT-L/14-336, anyres up to 2x2 tiles", "Mistral-7B",
           True, "llama", token_count_follows_image_size=True),
    Family("llava-onevision", "LLaVA-OneVision", "llava_onevision", "LlavaOnevisionForConditionalGeneration",
           "llava-hf/llava-onevision-qwen2-0.5b-ov-hf", "SigLIP so400m/14-384, anyres up to 9 tiles", "Qwen2",
           True, "qwen", token_count_follows_image_size=True),
)

MODEL_TYPES = ("llava", "llava_next", "llava_onevision")


def tower_shared(config) -> bool:
    return True


def family_of(config) -> str | None:
    mt = getattr(config, "model_type", None)
    if mt == "llava_next":
        return "llava-next"
    if mt == "llava_onevision":
        return "llava-onevision"
    if mt == "llava":
        vision = getattr(getattr(config, "vision_config", None), "model_type", "")
        return "llava-interleave" if vision == "siglip_vision_model" else "llava-1.5"
    return None


def config(family: str, tiny: bool = False, **ids):
    from ..configs import family_config

    return family_config(family, tiny, **ids)


def tiny_parts(family: str, seed: int = 0):
    from ..tiny import tiny_family_parts

    return tiny_family_parts(family, seed)


def save_tiny(path, family: str, seed: int = 0) -> str:
    from ..tiny import save_tiny_family

    return save_tiny_family(path, family, seed)


def load_processor(src: str, config, **kw):
    from ..loading import load_processor as load

    return load(src, config, **kw)


def chat_template(family: str) -> str:
    from ..chat import FAMILY_TEMPLATES

    return FAMILY_TEMPLATES[family]


def image_layout(config, processor, width: int, height: int):
    from ..layout import image_layout as layout

    return layout(config, processor, width, height)


def max_image_tokens(config, processor) -> int:
    from ..layout import max_image_tokens as most

    return most(config, processor)


def crop_patches(config, width: int, height: int):
    from ..layout import crop_patches as crops

    return crops(config, width, height)


def image_placeholder(processor) -> str:
    from ..families import IMAGE_TOKEN

    return IMAGE_TOKEN


def image_marker(processor) -> str:
    """What a user's `<image>` marker becomes in the rendered prompt: itself (the processor expands it)."""
    return image_placeholder(processor)


def rope_index(model, ids, vision_inputs):
    return None
