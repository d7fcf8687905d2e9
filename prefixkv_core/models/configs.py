"""LLaVA config factories: the one place that says what shape each model built in code has.

`tiny_config` is the test models' shape, `embedded_config` the embedded model's (its text config comes
from the GGUF it is assembled from).
"""
from __future__ import annotations

from .errors import ModelLoadError

# Custom key stored in config.json of models we build, so a saved copy loads back with its identity.
META_KEY = "prefixkv"

TINY_VARIANTS = ("llama", "qwen2")


def tiny_config(variant: str = "llama", *, vocab_size: int = 512, bos_token_id: int = 1, eos_token_id: int = 2,
                pad_token_id: int = 3, image_token_id: int = 4, **extra):
    """The test suite's tiny LLaVA: 2-layer CLIP at 32 px (16 image tokens), 4-layer 64-wide Llama (MHA) or
    Qwen2 (GQA, 2 KV heads). The default token ids are those of the tiny tokenizer (prefixkv_core.testing)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2Config

    vision = CLIPVisionConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=32,
    )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=2048,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
        # Larger than the usual 0.02 so that a random model has peaked, non-uniform attention and
        # varied greedy outputs (the engine tests need importance scores that differ between tokens).
        initializer_range=0.2,
    )
    if variant == "llama":
        text = LlamaConfig(num_key_value_heads=4, **common)
    elif variant == "qwen2":
        text = Qwen2Config(num_key_value_heads=2, **common)
    else:
        raise ModelLoadError(f"unknown tiny variant {variant!r}; accepted: {', '.join(TINY_VARIANTS)}")
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token_id,
        image_seq_length=(32 // 8) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        **extra,
    )


def embedded_vision_config():
    """The embedded model's small CLIP-style tower: 6 layers, 384 wide, 192 px in 16 px patches."""
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        image_size=192,
        patch_size=16,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=6,
        projection_dim=384,
    )


def embedded_config(text_config, image_token_id: int, **extra):
    """The embedded LLaVA around `text_config` (SmolLM2-135M's, tied embeddings): 144 image tokens."""
    from transformers import LlavaConfig

    vision = embedded_vision_config()
    return LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_id=image_token_id,
        image_seq_length=(vision.image_size // vision.patch_size) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=True,
        **extra,
    )
