"""LLaVA config factories: the one place that says what shape each model built in code has.

`tiny_config` is the test models' shape, `embedded_config` the embedded model's (assembled around the text
config of its GGUF, or around `smollm2_135m_text_config` for random weights), `llava_1_5_config` LLaVA-1.5 as
released. `random_config(kind)` names the shapes a randomly initialised model can take (speed benchmark).
"""
from __future__ import annotations

from typing import Any, Callable

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


def smollm2_135m_text_config():
    """SmolLM2-135M-Instruct as the embedded model holds it: its GGUF's shape with the vocabulary grown by the
    <image> token and padded to a multiple of 64 (49152 -> 49216), embeddings tied."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49216, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                       tie_word_embeddings=True)


def embedded_config(text_config=None, image_token_id: int = 49152, **extra):
    """The embedded LLaVA around `text_config` (default: SmolLM2-135M's shape): 144 image tokens, tied
    embeddings. The loader passes the text config read from the GGUF and the id it gave <image>."""
    from transformers import LlavaConfig

    vision = embedded_vision_config()
    return LlavaConfig(
        vision_config=vision,
        text_config=text_config if text_config is not None else smollm2_135m_text_config(),
        image_token_id=image_token_id,
        image_seq_length=(vision.image_size // vision.patch_size) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=True,
        **extra,
    )


def llava_1_5_config(size: str):
    """LLaVA-1.5 as released (llava-hf/llava-1.5-{7b,13b}-hf): CLIP ViT-L/14-336 + Llama-2 (Vicuna-1.5)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    sizes = {"7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32),
             "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                         num_key_value_heads=40)}
    if size not in sizes:
        raise ValueError(f"unknown LLaVA-1.5 size {size!r}; accepted: {', '.join(sizes)}")
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu",
                              layer_norm_eps=1e-5)
    text = LlamaConfig(vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                       hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=32001,
                       tie_word_embeddings=False, **sizes[size])
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=32000, image_seq_length=576,
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       projector_hidden_act="gelu", tie_word_embeddings=False)


RANDOM_CONFIGS: dict[str, Callable[[], Any]] = {
    "llava-1.5-7b": lambda: llava_1_5_config("7b"),
    "llava-1.5-13b": lambda: llava_1_5_config("13b"),
    "embedded": embedded_config,
    "tiny": tiny_config,
}


def random_config(kind: str):
    """The config of a randomly initialised model with the shapes of `kind` (one of RANDOM_CONFIGS)."""
    if kind not in RANDOM_CONFIGS:
        raise ValueError(f"unknown random-weight model {kind!r}; accepted: {', '.join(RANDOM_CONFIGS)}")
    return RANDOM_CONFIGS[kind]()
