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


# Random weights in the shape of each LLaVA family's example checkpoint ("llava-interleave": the Space default,
# llava-interleave-qwen-0.5b), or of its tiny test model ("tiny-llava-interleave"); these come with a processor
# (a small byte-level tokenizer, the family's image preprocessing), so image prompts run through the engine.
RANDOM_FAMILIES: dict[str, tuple[str, bool]] = {
    **{family: (family, False) for family in ("llava-1.5", "llava-interleave", "llava-next", "llava-onevision")},
    **{f"tiny-{family}": (family, True) for family in ("llava-1.5", "llava-interleave", "llava-next",
                                                       "llava-onevision")},
}
# Released shapes of the families whose module builds them (`random_parts`), with random weights and a processor
# ("qwen2.5-vl-3b": Qwen/Qwen2.5-VL-3B-Instruct; "internvl3-1b": OpenGVLab/InternVL3-1B-hf).
RANDOM_MROPE: dict[str, str] = {"qwen2.5-vl-3b": "qwen2.5-vl", "internvl3-1b": "internvl"}
RANDOM_KINDS = tuple(RANDOM_CONFIGS) + tuple(RANDOM_FAMILIES) + tuple(RANDOM_MROPE)


def random_config(kind: str, **ids):
    """The config of a randomly initialised model with the shapes of `kind` (one of RANDOM_KINDS). A family kind
    takes its tokenizer's token ids (`image_token_id`, `video_token_id`; a tiny one also vocab_size and
    bos/eos/pad_token_id); a released shape keeps its full vocabulary."""
    if kind in RANDOM_FAMILIES:
        family, tiny = RANDOM_FAMILIES[kind]
        return family_config(family, tiny, **ids)
    if kind in RANDOM_MROPE:
        return family_config(RANDOM_MROPE[kind], False, **ids)
    if kind not in RANDOM_CONFIGS:
        raise ValueError(f"unknown random-weight model {kind!r}; accepted: {', '.join(RANDOM_KINDS)}")
    return RANDOM_CONFIGS[kind]()


# -- the LLaVA families ----------------------------------------------------------------------------------------
#
# Each family's structure is taken from its released checkpoint; only the widths, depths and the image side are
# scaled down for the tiny test models. Where a value comes from:
#   llava-hf/llava-1.5-7b-hf            config.json (see `llava_1_5_config`) and transformers' LLaVA conversion
#                                        script (CLIP ViT-L/14-336, feature layer -2, "default" strategy)
#   llava-hf/llava-interleave-qwen-0.5b-hf  transformers' models/llava/convert_llava_weights_to_hf.py (SigLIP
#                                        so400m/14-384 without head, 26 layers; "full" strategy, feature layer -1;
#                                        image token 151646) on Qwen/Qwen1.5-0.5B-Chat's config.json
#   llava-hf/llava-v1.6-mistral-7b-hf    its config.json / preprocessor_config.json and transformers'
#                                        models/llava_next/convert_llava_next_weights_to_hf.py (CLIP ViT-L/14-336,
#                                        feature layer -2, "default", image_newline, grid pinpoints below, image
#                                        token 32000, pad 32001) on mistralai/Mistral-7B-Instruct-v0.2's config.json
#   llava-hf/llava-onevision-qwen2-0.5b-ov-hf  transformers' models/llava_onevision/
#                                        convert_llava_onevision_weights_to_hf.py (SigLIP as above, "full", feature
#                                        layer -1, 729 image tokens per view, anyres_max_9, image_newline, 6x6 grid
#                                        pinpoints of 384 px) on Qwen/Qwen2-0.5B-Instruct's config.json

LLAVA_FAMILIES = ("llava-1.5", "llava-interleave", "llava-next", "llava-onevision")  # FAMILY_INFO: all of them

# LLaVA-NeXT's pinpoints, (height, width) in pixels of 336 px tiles (llava-v1.6-mistral-7b-hf config.json)
NEXT_PINPOINTS_336 = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
# LLaVA-OneVision's: every (h, w) of 1..6 tiles of 384 px each way (llava-onevision-qwen2-0.5b-ov-hf config.json)
ONEVISION_PINPOINTS_384 = tuple((384 * a, 384 * b) for a in range(1, 7) for b in range(1, 7))
ONEVISION_ASPECT = "anyres_max_9"  # at most ~9 tiles' worth of high-resolution features (then downsampled)

TINY_SIDE, TINY_PATCH = 32, 8  # the tiny vision towers: 32 px views in 8 px patches (4 x 4 tokens a view)


def scale_pinpoints(pinpoints, tile: int, new_tile: int) -> list[list[int]]:
    """Grid pinpoints measured in tiles of `tile` px, re-expressed for tiles of `new_tile` px (same grids)."""
    return [[h // tile * new_tile, w // tile * new_tile] for h, w in pinpoints]


def _clip_vit_l_336(tiny: bool):
    """CLIP ViT-L/14 at 336 px (openai/clip-vit-large-patch14-336), or its 2-layer 32 px miniature."""
    from transformers import CLIPVisionConfig

    if tiny:
        return CLIPVisionConfig(image_size=TINY_SIDE, patch_size=TINY_PATCH, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2, projection_dim=32,
                                hidden_act="quick_gelu", layer_norm_eps=1e-5)
    return CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                            image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu",
                            layer_norm_eps=1e-5)


def _siglip_so400m_384(tiny: bool):
    """SigLIP so400m/14 at 384 px with its last layer and pooling head dropped, as the LLaVA ports hold it."""
    from transformers import SiglipVisionConfig

    if tiny:
        return SiglipVisionConfig(image_size=TINY_SIDE, patch_size=TINY_PATCH, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, vision_use_head=False)
    return SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16,
                              image_size=384, patch_size=14, vision_use_head=False)


_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=2048, initializer_range=0.2)  # 0.2: peaked attention (see tiny_config)


def _text_config(kind: str, tiny: bool, ids: dict):
    """The language model of a family: released shape, or the tiny one with the same kind of attention (MHA or
    GQA) and the tiny tokenizer's ids."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if kind == "vicuna-7b":  # lmsys/vicuna-7b-v1.5 (Llama-2 7B), as in llava-1.5-7b-hf
        cls, full = LlamaConfig, dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                      max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=32001, tie_word_embeddings=False)
        small = dict(num_key_value_heads=4, tie_word_embeddings=False)  # MHA
    elif kind == "mistral-7b":  # mistralai/Mistral-7B-Instruct-v0.2, vocabulary grown to 32064
        cls, full = MistralConfig, dict(vocab_size=32064, hidden_size=4096, intermediate_size=14336,
                                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                                        sliding_window=None, bos_token_id=1, eos_token_id=2, pad_token_id=32001,
                                        tie_word_embeddings=False)
        small = dict(num_key_value_heads=1, sliding_window=None, tie_word_embeddings=False)  # GQA 4:1, as 32:8
    elif kind == "qwen1.5-0.5b":  # Qwen/Qwen1.5-0.5B-Chat (MHA, tied embeddings), vocabulary padded to 152000
        cls, full = Qwen2Config, dict(vocab_size=152000, hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                                      max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                      bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=True)
        small = dict(num_key_value_heads=4, tie_word_embeddings=True)  # MHA
    elif kind == "qwen2-0.5b":  # Qwen/Qwen2-0.5B-Instruct (GQA 14:2, tied embeddings), vocabulary padded to 152000
        cls, full = Qwen2Config, dict(vocab_size=152000, hidden_size=896, intermediate_size=4864,
                                      num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                      max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                      bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=True)
        small = dict(num_key_value_heads=2, tie_word_embeddings=True)  # GQA
    else:
        raise ValueError(f"unknown text model {kind!r}")
    if not tiny:
        return cls(hidden_act="silu", **full)
    return cls(hidden_act="silu", **_TINY_TEXT, **small, **ids)


def family_config(family: str, tiny: bool = False, *, image_token_id: int | None = None,
                  video_token_id: int | None = None, meta: dict | None = None, **text_ids):
    """The model config of a LLaVA family: as released (`tiny=False`, the example checkpoint's shape) or the
    tiny test model's shape (same vision tower type, feature layer and strategy, projector, image newline, grid
    pinpoints in tiles, text model family; small widths and a 32 px view). `text_ids` (vocab_size,
    bos/eos/pad_token_id) and the image/video token ids are the tiny tokenizer's for tiny models; `meta` is
    stored under META_KEY so a saved copy loads back with its identity."""
    from transformers import LlavaConfig, LlavaNextConfig, LlavaOnevisionConfig

    from .families import FAMILY_INFO, hooks

    if family not in LLAVA_FAMILIES and family in FAMILY_INFO:  # another family module's
        return hooks(family).config(family, tiny, image_token_id=image_token_id, video_token_id=video_token_id,
                                    meta=meta, **text_ids)
    if family not in LLAVA_FAMILIES:
        raise ModelLoadError(f"unknown LLaVA family {family!r}; accepted: {', '.join(LLAVA_FAMILIES)}")
    if tiny and image_token_id is None:
        raise ValueError("a tiny family model needs its tokenizer's image token id")
    extra = {META_KEY: meta} if meta else {}
    if family == "llava-1.5":
        vision, text = _clip_vit_l_336(tiny), _text_config("vicuna-7b", tiny, text_ids)
        side = vision.image_size // vision.patch_size
        return LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id or 32000,
                           image_seq_length=side * side, vision_feature_layer=-2,
                           vision_feature_select_strategy="default", projector_hidden_act="gelu",
                           tie_word_embeddings=False, **extra)
    if family == "llava-interleave":
        vision, text = _siglip_so400m_384(tiny), _text_config("qwen1.5-0.5b", tiny, text_ids)
        side = vision.image_size // vision.patch_size
        return LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id or 151646,
                           image_seq_length=side * side, vision_feature_layer=-1,
                           vision_feature_select_strategy="full", projector_hidden_act="gelu",
                           tie_word_embeddings=text.tie_word_embeddings, **extra)
    if family == "llava-next":
        vision, text = _clip_vit_l_336(tiny), _text_config("mistral-7b", tiny, text_ids)
        pins = scale_pinpoints(NEXT_PINPOINTS_336, 336, vision.image_size)
        return LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=image_token_id or 32000,
                               image_grid_pinpoints=pins, vision_feature_layer=-2,
                               vision_feature_select_strategy="default", projector_hidden_act="gelu",
                               image_seq_length=(vision.image_size // vision.patch_size) ** 2,
                               tie_word_embeddings=False, **extra)
    vision, text = _siglip_so400m_384(tiny), _text_config("qwen2-0.5b", tiny, text_ids)
    pins = scale_pinpoints(ONEVISION_PINPOINTS_384, 384, vision.image_size)
    return LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=image_token_id or 151646,
                                video_token_index=video_token_id or 151647, image_grid_pinpoints=pins,
                                vision_feature_layer=-1, vision_feature_select_strategy="full",
                                vision_aspect_ratio=ONEVISION_ASPECT, projector_hidden_act="gelu",
                                tie_word_embeddings=text.tie_word_embeddings, **extra)
