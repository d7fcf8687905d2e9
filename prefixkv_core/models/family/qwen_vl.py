"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a ViT over a dynamic resolution (the image resized to a multiple of
patch x merge pixels between the processor's min and max pixels), a 2x2 patch merger, and M-RoPE positions.

Positions. Text tokens get (p, p, p); an image's tokens get (t, h, w) offsets on its merged grid from where it
starts, and the image advances the position by max(h, w), not by its number of tokens. `rope_index` is the model's
own `get_rope_index` over the prompt (the image and video grids from the processor, Qwen2.5-VL's
second_per_grid_ts, the token types from the ids; a video's tokens get one temporal step per group of frames, on
Qwen3-VL each group's grid after its timestamp's text); what follows the prompt runs at its true position plus the
prompt's rope delta. The engine keeps every entry's true position (`TrackedCache`) and passes the logical ones
explicitly, so an evicted cache never changes a surviving entry's rotation nor the next token's position.

Processors. transformers builds a Qwen-VL processor only together with its video processor, which needs
torchvision; where it is missing (PyPI's torchvision does not match the CPU torch wheel) the checkpoint's
processor is rebuilt without it (`image_only_processor_class`): the tokenizer, the image processor's PIL backend,
the chat template. Qwen2-VL, Qwen2.5-VL and Qwen3-VL then read a video on their own path, its pixels from
transformers' video processor where it builds, else from the same steps on the PIL backend, and Qwen3-VL's prompt
with a timestamp before each temporal group, as its processor writes it (`qwen_vl_video`).

The tiny test models keep each family's structure (Qwen2-VL's tower and merger, Qwen2.5-VL's window attention
with one full-attention block, Qwen3-VL's learned position grid and DeepStack merger, GQA text models) with small
widths and 8 px patches. Their heads have 8 rotary pairs, split mrope_section [2, 3, 3] (temporal, height, width)
in all three: Qwen2-VL's and Qwen2.5-VL's released [16, 24, 24] of 64 pairs scaled down. Qwen3-VL's tiny model
takes the same [2, 3, 3] in the interleaved layout (`mrope_interleaved`); the released Qwen3-VL splits its 64
pairs [24, 20, 20], interleaved, so the tiny split is not that one scaled."""
from __future__ import annotations

import json
import os

from .base import Family
from .qwen_vl_shape import (IMAGE_PAD, SPECIAL_TOKENS, TINY_MAX_PIXELS, TINY_MERGE, TINY_MIN_PIXELS,  # noqa: F401
                            TINY_PATCH, VIDEO_PAD, VISION_END, VISION_START)
from .qwen_vl_video import (VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, VIDEO_MODEL_TYPES, attach_video,  # noqa: F401
                            frames_per_token, reads_video, video_grid, video_inputs, video_layout,
                            video_preprocessor_config, video_settings, video_span, video_text_tokens,
                            video_token_count)

FAMILIES = (
    Family("qwen2-vl", "Qwen2-VL", "qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen/Qwen2-VL-2B-Instruct",
           "ViT-600M/14, 2x2 merger, dynamic resolution", "Qwen2", True, "qwen-vl", "qwen_vl", True,
           token_count_follows_image_size=True),
    Family("qwen2.5-vl", "Qwen2.5-VL", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
           "Qwen/Qwen2.5-VL-3B-Instruct", "ViT/14 with window attention, 2x2 merger, dynamic resolution",
           "Qwen2.5", True, "qwen-vl", "qwen_vl", True,
           token_count_follows_image_size=True),
    Family("qwen3-vl", "Qwen3-VL", "qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen/Qwen3-VL-2B-Instruct",
           "SigLIP-2 ViT/16, 2x2 merger, DeepStack, dynamic resolution", "Qwen3", True, "qwen-vl", "qwen_vl",
           True, token_count_follows_image_size=True),
)

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_BY_TYPE = {f.model_type: f.key for f in FAMILIES}
_PROCESSOR_CLASS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                    "qwen3_vl": "Qwen3VLProcessor"}
_CONFIG_CLASS = {"qwen2-vl": "Qwen2VLConfig", "qwen2.5-vl": "Qwen2_5_VLConfig", "qwen3-vl": "Qwen3VLConfig"}


def family_of(config) -> str | None:
    return _BY_TYPE.get(getattr(config, "model_type", None))


def tower_shared(config) -> bool:
    """Qwen3-VL adds DeepStack features to the first layers' hidden states at the visual positions: its prefills
    read the pixels (the model's own path); the others take the tower's features as input embeddings."""
    return getattr(config, "model_type", None) != "qwen3_vl"


# -- chat templates ----------------------------------------------------------------------------------------------
# As the released checkpoints render a conversation: ChatML, each image as <|vision_start|><|image_pad|>
# <|vision_end|> where it stands among the content items; Qwen2-VL and Qwen2.5-VL open with the default system
# turn "You are a helpful assistant.", Qwen3-VL opens with none.
_DEFAULT_SYSTEM = "You are a helpful assistant."


def _template(default_system: str | None) -> str:
    system = ""
    if default_system:
        system = ("{%- if loop.first and message['role'] != 'system' -%}"
                  "{{ '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}{%- endif -%}")
    return (
        "{%- for message in messages -%}" + system
        + "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
        "{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'image' -%}{{ '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
        "{%- elif item['type'] == 'video' -%}{{ '" + VISION_START + VIDEO_PAD + VISION_END + "' }}"
        "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


TEMPLATES = {"qwen2-vl": _template(_DEFAULT_SYSTEM), "qwen2.5-vl": _template(_DEFAULT_SYSTEM),
             "qwen3-vl": _template(None)}


def chat_template(family: str) -> str:
    return TEMPLATES[family]


def image_placeholder(processor) -> str:
    return getattr(processor, "image_token", None) or IMAGE_PAD


def image_marker(processor) -> str:
    """What a user's `<image>` marker becomes in the rendered prompt: one image's vision span."""
    return VISION_START + image_placeholder(processor) + VISION_END


def video_marker(processor) -> str:
    """What a user's `<video>` marker becomes in the rendered prompt of a family that reads video natively: the
    chat template's video span, its `<|video_pad|>` held by the marker until `encode` expands it."""
    from ..video import VIDEO_TOKEN

    return VISION_START + VIDEO_TOKEN + VISION_END


# -- configs -----------------------------------------------------------------------------------------------------
_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2, rms_norm_eps=1e-6)
# 8 rotary pairs a head, split 2/3/3 (temporal, height, width): Qwen2-VL's and Qwen2.5-VL's released 16/24/24 of 64
# pairs scaled down. Qwen3-VL's tiny model uses the same split, interleaved (set below); the released Qwen3-VL's
# is [24, 20, 20], interleaved, which this split does not scale.
_TINY_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}


def config(family: str, tiny: bool = False, *, image_token_id: int | None = None, video_token_id: int | None = None,
           vision_start_token_id: int | None = None, vision_end_token_id: int | None = None, meta: dict | None = None,
           **text_ids):
    """The tiny test model's config of a Qwen-VL family (`tiny=True`; the released shapes load from their
    checkpoints). `text_ids`: vocab_size, bos/eos/pad_token_id of the tiny tokenizer."""
    import transformers

    from ..configs import META_KEY
    from ..errors import ModelLoadError

    if family not in _CONFIG_CLASS:
        raise ModelLoadError(f"unknown Qwen-VL family {family!r}; accepted: {', '.join(_CONFIG_CLASS)}")
    if not tiny:
        return _released(family, image_token_id=image_token_id, video_token_id=video_token_id,
                         vision_start_token_id=vision_start_token_id, vision_end_token_id=vision_end_token_id)
    if image_token_id is None:
        raise ValueError("a tiny family model needs its tokenizer's image token id")
    hidden = _TINY_TEXT["hidden_size"]
    rope = dict(_TINY_ROPE)
    text = dict(_TINY_TEXT, rope_parameters=rope, **text_ids)
    if family == "qwen2-vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=hidden, mlp_ratio=2, num_heads=2, patch_size=TINY_PATCH,
                      spatial_merge_size=TINY_MERGE, temporal_patch_size=2)
    elif family == "qwen2.5-vl":  # window attention over 2x2 merged units, the last block attends over the image
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                      patch_size=TINY_PATCH, spatial_merge_size=TINY_MERGE, temporal_patch_size=2,
                      window_size=2 * TINY_MERGE * TINY_PATCH, fullatt_block_indexes=[1], tokens_per_second=2)
    else:  # learned positions on a 4x4 grid, DeepStack from both blocks (added after the first two text layers)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                      patch_size=TINY_PATCH, spatial_merge_size=TINY_MERGE, temporal_patch_size=2,
                      num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        rope["mrope_interleaved"] = True
        text["head_dim"] = hidden // _TINY_TEXT["num_attention_heads"]
    extra = {META_KEY: meta} if meta else {}
    ids = dict(image_token_id=image_token_id, video_token_id=video_token_id,
               vision_start_token_id=vision_start_token_id, vision_end_token_id=vision_end_token_id)
    return getattr(transformers, _CONFIG_CLASS[family])(
        vision_config=vision, text_config=text, tie_word_embeddings=True,
        **{k: v for k, v in ids.items() if v is not None}, **extra)


# Qwen/Qwen2.5-VL-3B-Instruct's config.json: the shape the speed benchmarks measure with random weights.
QWEN2_5_VL_3B = dict(
    text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
              num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
              hidden_act="silu", bos_token_id=151643, eos_token_id=151645, use_sliding_window=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu"),
    ids=dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653),
)


def _released(family: str, **ids):
    """A released checkpoint's config built in code (Qwen2.5-VL-3B; the others load from their checkpoints). `ids`:
    token ids that replace the released ones (a stand-in tokenizer's), None keeps them."""
    from transformers import Qwen2_5_VLConfig

    from ..errors import ModelLoadError

    if family != "qwen2.5-vl":
        raise ModelLoadError(f"{family}: only the tiny shape is built in code; load a released checkpoint by its "
                             "hub id or directory")
    shape = QWEN2_5_VL_3B
    token_ids = {k: (v if ids.get(k) is None else ids[k]) for k, v in shape["ids"].items()}
    return Qwen2_5_VLConfig(text_config=dict(shape["text"]), vision_config=dict(shape["vision"]),
                            tie_word_embeddings=True, **token_ids)


# -- processors ----------------------------------------------------------------------------------------------------

def image_only_processor_class(model_type: str):
    """The family's processor without its video processor (see the module doc): its image and text handling is the
    released class's own."""
    import transformers

    base = getattr(transformers, _PROCESSOR_CLASS[model_type])

    class ImageOnlyProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # ProcessorMixin takes its parts from this signature: image_processor and tokenizer only
            base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = "ImageOnly" + base.__name__
    return ImageOnlyProcessor


def image_processor_for(config, tiny: bool = True):
    """The PIL backend of the family's image processor at the model's patch and merge sizes, with the tiny
    model's pixel limits (else the class's defaults)."""
    from transformers import Qwen2VLImageProcessorPil

    vc = config.vision_config
    extra = {}
    if tiny:
        extra["size"] = {"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS}
    if config.model_type == "qwen3_vl":  # SigLIP-2 normalisation
        extra.update(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return Qwen2VLImageProcessorPil(patch_size=int(vc.patch_size), merge_size=int(vc.spatial_merge_size),
                                    temporal_patch_size=int(vc.temporal_patch_size), **extra)


def processor(config, tokenizer, template: str):
    """The processor of a model built in code: the tiny model's pixel limits, or the released defaults for a
    released shape (its vision tower wider than the tiny one's)."""
    tiny = int(config.vision_config.patch_size) == TINY_PATCH
    made = image_only_processor_class(config.model_type)(image_processor=image_processor_for(config, tiny),
                                                         tokenizer=tokenizer, chat_template=template)
    return attach_video(made, config, tiny=tiny)


def random_parts(family: str, device, dtype, seed: int = 0):
    """(model with random weights in the released shape, created on `device` in `dtype`, processor on a
    stand-in tokenizer whose special ids become the model's) for the speed benchmarks."""
    from ..families import model_class
    from ..device import instantiate

    tok = build_tokenizer()
    token = tok.convert_tokens_to_ids
    cfg = config(family, tiny=False, image_token_id=token(IMAGE_PAD), video_token_id=token(VIDEO_PAD),
                 vision_start_token_id=token(VISION_START), vision_end_token_id=token(VISION_END))
    model = instantiate(model_class(cfg), cfg, device, dtype, seed)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id = tok.pad_token_id, tok.eos_token_id
    return model, processor(cfg, tok, TEMPLATES[family])


def load_processor(src: str, config, **kw):
    """The checkpoint's processor: transformers' own where it builds (torchvision present), else the same without
    its video processor."""
    from transformers import AutoProcessor

    try:
        return attach_video(AutoProcessor.from_pretrained(src, **kw), config, src)
    except Exception:  # noqa: BLE001 - no torchvision: the image-only processor from the same files
        return attach_video(image_only_processor_class(config.model_type).from_pretrained(src, **kw), config, src)


# -- tiny models ---------------------------------------------------------------------------------------------------

def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with Qwen-VL's special tokens (ChatML, vision start/end, image and video pads)."""
    from ..tiny import build_family_tokenizer

    return build_family_tokenizer("qwen-vl", vocab_size)


def tiny_parts(family: str, seed: int = 0):
    """(model in float32 eval mode, processor) of a tiny random model of a Qwen-VL family."""
    import torch

    from ..families import model_class

    tok = build_tokenizer()
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    token = tok.convert_tokens_to_ids
    cfg = config(family, tiny=True, image_token_id=token(IMAGE_PAD), video_token_id=token(VIDEO_PAD),
                 vision_start_token_id=token(VISION_START), vision_end_token_id=token(VISION_END),
                 meta={"kind": "tiny", "family": family, "vision_trained": False, "slug": f"tiny-{family}"}, **ids)
    torch.manual_seed(seed)
    model = model_class(cfg)(cfg)
    model.to(torch.float32).eval()
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id = tok.pad_token_id, tok.eos_token_id
    return model, processor(cfg, tok, TEMPLATES[family])


def save_tiny(path, family: str, seed: int = 0) -> str:
    """Write a tiny Qwen-VL model as a checkpoint directory laid out as the released one (its processor named by
    the released class), so `load_model(path)` takes the same path as for a hub checkpoint."""
    model, proc = tiny_parts(family, seed)
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    for name in ("processor_config.json", "tokenizer_config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as fh:
                data = json.load(fh)
            if "processor_class" in data:
                data["processor_class"] = _PROCESSOR_CLASS[model.config.model_type]
            with open(file, "w") as fh:
                json.dump(data, fh, indent=2)
    settings = getattr(proc, "prefixkv_video_settings", None)
    if settings is not None:  # the video processor's settings, where the released checkpoint keeps them
        with open(os.path.join(path, "video_preprocessor_config.json"), "w") as fh:
            json.dump(video_preprocessor_config(settings, model.config.model_type), fh, indent=2)
    return path


# -- the image grid --------------------------------------------------------------------------------------------

def _resize_args(config, processor) -> tuple[int, int, int]:
    """(factor = patch x merge, min pixels, max pixels) of the processor's resize (the class defaults without one)."""
    from transformers import Qwen2VLImageProcessorPil as Pil

    ip = getattr(processor, "image_processor", None) if processor is not None else None
    vc = config.vision_config
    patch = int(getattr(ip, "patch_size", None) or vc.patch_size)
    merge = int(getattr(ip, "merge_size", None) or vc.spatial_merge_size)
    size = getattr(ip, "size", None) or Pil.size
    get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
    return patch * merge, int(get("shortest_edge", Pil.size["shortest_edge"])), \
        int(get("longest_edge", Pil.size["longest_edge"]))


def merged_grid(config, processor, width: int, height: int) -> tuple[int, int]:
    """(rows, cols) of an image's merged tokens: the image resized as the processor does, in patch x merge cells."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    factor, lo, hi = _resize_args(config, processor)
    h, w = smart_resize(int(height), int(width), factor=factor, min_pixels=lo, max_pixels=hi)
    return h // factor, w // factor


def image_layout(config, processor, width: int, height: int):
    """One view over the whole image: its merged grid (t = 1 for an image), row-major, no newline tokens."""
    from ..layout import GridView, ImageLayout

    rows, cols = merged_grid(config, processor, width, height)
    return ImageLayout((GridView("image", rows, cols),), (int(width), int(height)))


def max_image_tokens(config, processor) -> int:
    factor, _, hi = _resize_args(config, processor)
    return max(1, hi // (factor * factor))


def crop_patches(config, width: int, height: int):
    """No fixed crop of patches per token here: the tower reads each 2x2 merge group's patches one after the other
    and the merger makes them one token, so the vision-side reductions read Qwen's tower per merged token
    (`decoding.qwen_vision`) and an image's tokens are its merged grid (`image_layout`)."""
    raise ValueError(f"{config.model_type} has no per-patch crop map: its vision-side reductions read the tower per "
                     "merged token (decoding.qwen_vision)")


# -- positions -----------------------------------------------------------------------------------------------------

def rope_index(model, ids, vision_inputs):
    """(position ids [3, B, N], rope deltas [B]) of a prompt, from the model's own `get_rope_index`: the token types
    from the ids (image and video pads), the grids from the processor's output."""
    import torch

    cfg = model.config
    types = torch.zeros_like(ids, dtype=torch.int)
    types[ids == int(cfg.image_token_id)] = 1
    if getattr(cfg, "video_token_id", None) is not None:
        types[ids == int(cfg.video_token_id)] = 2
    inputs = dict(vision_inputs or {}) if not isinstance(vision_inputs, torch.Tensor) else {}
    image_grid, video_grid = inputs.get("image_grid_thw"), inputs.get("video_grid_thw")
    if not bool(types.any()):
        positions = torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, ids.shape[0], -1)
        return positions, torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    if (image_grid is None and bool((types == 1).any())) or (video_grid is None and bool((types == 2).any())):
        raise ValueError("the 3-D positions of a prompt's image tokens need its image grid (image_grid_thw)")
    extra = {}
    if video_grid is not None and inputs.get("second_per_grid_ts") is not None:
        extra["second_per_grid_ts"] = inputs["second_per_grid_ts"]
    positions, deltas = model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=image_grid,
                                                   video_grid_thw=video_grid, **extra)
    return positions, deltas.reshape(-1).long()
