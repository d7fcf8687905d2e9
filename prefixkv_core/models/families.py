"""The LLaVA families the engine runs: what each is, which transformers class loads it, one checkpoint each.

A checkpoint's family follows from its config: `model_type` picks the class (llava, llava_next,
llava_onevision); among `llava` checkpoints a SigLIP vision tower marks LLaVA-Interleave.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ModelLoadError

# The placeholder every family's processor expands into its image tokens (prompts, chat templates, tests).
IMAGE_TOKEN = "<image>"


@dataclass(frozen=True)
class Family:
    key: str
    label: str
    model_type: str
    model_class: str  # the transformers class that loads it
    example: str  # one released checkpoint
    vision: str
    text: str
    anyres: bool  # a variable number of image tokens per image (base view + high-resolution tiles)
    tokenizer: str  # "llama" (SentencePiece-style, BOS added) or "qwen" (ChatML, no BOS): the tiny models' kind


FAMILY_INFO: dict[str, Family] = {
    f.key: f for f in (
        Family("llava-1.5", "LLaVA-1.5", "llava", "LlavaForConditionalGeneration", "llava-hf/llava-1.5-7b-hf",
               "CLIP ViT-L/14-336 (576 tokens)", "Vicuna-1.5 (Llama-2)", False, "llama"),
        Family("llava-interleave", "LLaVA-Interleave", "llava", "LlavaForConditionalGeneration",
               "llava-hf/llava-interleave-qwen-0.5b-hf", "SigLIP so400m/14-384 (729 tokens)", "Qwen1.5", False,
               "qwen"),
        Family("llava-next", "LLaVA-NeXT (1.6)", "llava_next", "LlavaNextForConditionalGeneration",
               "llava-hf/llava-v1.6-mistral-7b-hf", "CLIP ViT-L/14-336, anyres up to 2x2 tiles", "Mistral-7B",
               True, "llama"),
        Family("llava-onevision", "LLaVA-OneVision", "llava_onevision", "LlavaOnevisionForConditionalGeneration",
               "llava-hf/llava-onevision-qwen2-0.5b-ov-hf", "SigLIP so400m/14-384, anyres up to 9 tiles", "Qwen2",
               True, "qwen"),
    )
}

SUPPORTED_MODEL_TYPES = ("llava", "llava_next", "llava_onevision")


def supported_text() -> str:
    """One line naming every supported family with its model_type and an example checkpoint."""
    return "; ".join(f"{f.label} (model_type {f.model_type!r}, e.g. {f.example})" for f in FAMILY_INFO.values())


def family_of(config) -> str:
    """The family key of a LLaVA config (ModelLoadError for other model types)."""
    mt = getattr(config, "model_type", None)
    if mt == "llava_next":
        return "llava-next"
    if mt == "llava_onevision":
        return "llava-onevision"
    if mt == "llava":
        vision = getattr(getattr(config, "vision_config", None), "model_type", "")
        return "llava-interleave" if vision == "siglip_vision_model" else "llava-1.5"
    raise ModelLoadError(f"model_type {mt!r} is not a supported LLaVA family. Supported: {supported_text()}")


def model_class(config):
    """The transformers class that loads a checkpoint of this config."""
    import transformers

    return getattr(transformers, FAMILY_INFO[family_of(config)].model_class)
