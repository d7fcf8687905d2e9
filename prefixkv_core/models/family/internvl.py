"""InternVL (InternVL2.5, InternVL3) in transformers' own format (`internvl`, the "-hf" checkpoints): an InternViT
tower, a pixel shuffle that folds every 2x2 block of patches into one token (downsample_ratio 0.5: a 448 px tile
of 32x32 patches becomes 16x16 = 256 tokens), an MLP projector, and a Qwen2 / Qwen2.5 (InternVL3) or Llama-like
(InternVL2.5's InternLM2) language model with 1-D rotary positions.

Tiles. The image processor (GotOcr2's) picks the grid of tiles whose aspect ratio is closest to the image's among
those of min_patches to max_patches tiles (on a tie, the grid of more tiles while the image's area is above half of
theirs), resizes the image to that grid and cuts it into tiles, and adds the whole image squashed to one tile (the
thumbnail) when there is more than one. So an image's token count follows its aspect ratio, and its size where
grids tie (a large square image gets 2x2 tiles and a thumbnail, a small one a single tile). In the prompt the image
is `<img>` + 256 `<IMG_CONTEXT>` tokens per tile + `</img>`; only the `<IMG_CONTEXT>` tokens are image tokens.

The overlay's layout (`image_layout`) has one view per tile, in the tower's order (the tiles row by row, then the
thumbnail), each the tile's merged grid over the part of the image it shows: a tile's tokens follow its 2x2
blocks row by row, as the pixel shuffle packs them.

Processors. transformers builds an InternVLProcessor only together with its video processor, which needs
torchvision; where it is missing (PyPI's torchvision does not match the CPU torch wheel) the checkpoint's
processor is rebuilt without it (`image_only_processor_class`): the tokenizer, the image processor (its PIL
backend, `GotOcr2ImageProcessorPil`), the chat template. A video is read as a run of images (its frames).

Vision-side reductions (VisionZip, Downsample's projector_in / projector_out) read the tower per image token
(`pixel_shuffled`, `decoding.internvl_vision`): the pixel shuffle concatenates each 2x2 block of patches before the
projector, so the feature layer's attention and keys are pooled over each block, every tile (the thumbnail
included) is a crop, and a plan weighs the pixel-shuffled vectors (or the projector's outputs). Downsample's
default on InternVL resizes the image before the tower (its tile count follows the image's size).

The tiny test model keeps the structure (an InternViT with a CLS token and absolute positions, the pixel shuffle,
the projector, a Qwen2 GQA language model) with small widths, 4 px patches and 32 px tiles (16 tokens a tile, up to
4 tiles and a thumbnail)."""
from __future__ import annotations

import json
import os

from .base import Family

FAMILIES = (
    Family("internvl", "InternVL", "internvl", "InternVLForConditionalGeneration", "OpenGVLab/InternVL3-1B-hf",
           "InternViT-300M/14-448, pixel shuffle (256 tokens a tile), up to 12 tiles + a thumbnail",
           "Qwen2.5 (InternVL3), Qwen2 / InternLM2 (InternVL2.5)", True, "internvl", "internvl",
           token_count_follows_image_size=True),
)

MODEL_TYPES = ("internvl",)

IMG_START, IMG_END, IMG_CONTEXT, VIDEO = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", IMG_START, IMG_END, IMG_CONTEXT, VIDEO]
# how the released tokenizers name them (the processor reads these attributes)
EXTRA_SPECIAL = {"start_image_token": IMG_START, "end_image_token": IMG_END, "context_image_token": IMG_CONTEXT,
                 "video_token": VIDEO}
PROCESSOR_CLASS = "InternVLProcessor"
# ImageNet's mean and std (the released preprocessor_config.json)
IMAGE_MEAN, IMAGE_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def family_of(config) -> str | None:
    return "internvl" if getattr(config, "model_type", None) == "internvl" else None


def tower_shared(config) -> bool:
    """The model adds the projected tiles' features as the image tokens' embeddings, nothing more."""
    return True


def rope_index(model, ids, vision_inputs):
    return None  # 1-D rotary positions: one number per token


# -- chat template ------------------------------------------------------------------------------------------------
# As the "-hf" checkpoints render a conversation (transformers' conversion script): ChatML without a default system
# turn, each image item as "<IMG_CONTEXT>\n" (the processor expands it into <img> + the tiles' tokens + </img>).
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '" + IMG_CONTEXT + "\\n' }}"
    "{%- elif item['type'] == 'video' -%}{{ '" + VIDEO + "\\n' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def chat_template(family: str) -> str:
    return TEMPLATE


def image_placeholder(processor) -> str:
    return getattr(processor, "image_token", None) or IMG_CONTEXT


def image_wrap_tokens(processor) -> int:
    """The text tokens the processor adds around each image's tokens: <img> and </img>."""
    return 2


def image_marker(processor) -> str:
    """What a user's `<image>` marker becomes in the rendered prompt: the placeholder the processor expands."""
    return image_placeholder(processor)


# -- configs -------------------------------------------------------------------------------------------------------
TINY_TILE, TINY_PATCH, TINY_MAX_TILES = 32, 4, 4
_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=TINY_TILE, patch_size=TINY_PATCH, attention_bias=True, use_qk_norm=False,
                    norm_type="layer_norm", hidden_act="gelu", initializer_range=0.2)
_TINY_TEXT = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2,
                  rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True)

# OpenGVLab/InternVL3-1B-hf's config.json: InternViT-300M-448px-V2.5 and Qwen2.5-0.5B (its full vocabulary, an
# output layer of its own: 0.94 B parameters)
INTERNVL3_1B = dict(
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                image_size=448, patch_size=14, attention_bias=True, use_qk_norm=False, norm_type="layer_norm",
                hidden_act="gelu", layer_norm_eps=1e-6, layer_scale_init_value=0.1, use_mean_pooling=True),
    text=dict(model_type="qwen2", vocab_size=151674, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
              hidden_act="silu", bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False,
              use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    ids=dict(image_token_id=151667),
)


def config(family: str, tiny: bool = False, *, image_token_id: int | None = None, video_token_id: int | None = None,
           meta: dict | None = None, **text_ids):
    """The InternVL config of a model built in code: the tiny test shape (`tiny=True`; `text_ids`: vocab_size,
    bos/eos/pad_token_id of the tiny tokenizer) or InternVL3-1B's released shape (its image token id replaced by a
    stand-in tokenizer's where given). InternVL has no video token: a video is read as images."""
    from transformers import InternVLConfig

    from ..configs import META_KEY
    from ..errors import ModelLoadError

    if family != "internvl":
        raise ModelLoadError(f"unknown InternVL family {family!r}; accepted: internvl")
    extra = {META_KEY: meta} if meta else {}
    if not tiny:
        shape = INTERNVL3_1B
        text = dict(shape["text"], **{k: v for k, v in text_ids.items() if k != "vocab_size" and v is not None})
        return InternVLConfig(vision_config=dict(shape["vision"]), text_config=text,
                              image_token_id=image_token_id if image_token_id is not None else
                              shape["ids"]["image_token_id"], image_seq_length=256, downsample_ratio=0.5,
                              projector_hidden_act="gelu", vision_feature_layer=-1,
                              vision_feature_select_strategy="default", tie_word_embeddings=False, **extra)
    if image_token_id is None:
        raise ValueError("a tiny family model needs its tokenizer's image token id")
    side = TINY_TILE // TINY_PATCH // 2
    return InternVLConfig(vision_config=dict(_TINY_VISION), text_config=dict(_TINY_TEXT, **text_ids),
                          image_token_id=image_token_id, image_seq_length=side * side, downsample_ratio=0.5,
                          projector_hidden_act="gelu", vision_feature_layer=-1,
                          vision_feature_select_strategy="default", tie_word_embeddings=True, **extra)


# -- the tile geometry ---------------------------------------------------------------------------------------------

def _side(value) -> int:
    """One side of a vision config's image_size / patch_size (an int, or a (height, width) pair)."""
    return int(value[0]) if isinstance(value, (list, tuple)) else int(value)


def tokens_per_tile(config) -> int:
    """The tokens of one tile: its patch grid halved on each side by the pixel shuffle (256 at 448 px / 14 px)."""
    side = merged_side(config)
    return side * side


def merged_side(config) -> int:
    vc = config.vision_config
    return int(round(_side(vc.image_size) // _side(vc.patch_size) * float(config.downsample_ratio)))


def _tiling(config, processor) -> dict:
    """The processor's tiling: crop_to_patches, min_patches, max_patches and the tile size (height, width), as its
    call merges them (the processor turns tiling on by default); the released defaults without a processor."""
    vc = config.vision_config
    tile = (_side(vc.image_size),) * 2
    found = {"crop_to_patches": True, "min_patches": 1, "max_patches": 12, "tile": tile}
    ip = getattr(processor, "image_processor", None) if processor is not None else None
    if ip is None:
        return found
    kwargs = {}
    try:
        kwargs = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs)["images_kwargs"]
    except Exception:  # noqa: BLE001 - a processor that merges no kwargs: its image processor's own settings
        pass
    for key in ("crop_to_patches", "min_patches", "max_patches"):
        value = kwargs.get(key, getattr(ip, key, None))
        if value is not None:
            found[key] = value
    size = kwargs.get("size") or getattr(ip, "size", None)
    get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
    if size is not None and get("height") and get("width"):
        found["tile"] = (int(get("height")), int(get("width")))
    return found


def tile_grid(config, processor, width: int, height: int) -> tuple[int, int]:
    """(rows, cols) of the tiles an image of `width` x `height` pixels is cut into ((1, 1): one tile, no
    thumbnail), as the image processor picks them."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    t = _tiling(config, processor)
    if not t["crop_to_patches"] or int(t["max_patches"]) <= 1:
        return 1, 1
    cols, rows = get_optimal_tiled_canvas((int(height), int(width)), tuple(t["tile"]), int(t["min_patches"]),
                                          int(t["max_patches"]))
    return int(rows), int(cols)


def image_layout(config, processor, width: int, height: int):
    """One view per tile the tower encodes, in its order: the tiles row by row, each over the part of the image it
    shows, then the thumbnail over the whole image (only when there are several tiles); each view is the tile's
    merged grid (16x16 at 448 px), row-major, no newline tokens."""
    from ..layout import GridView, ImageLayout

    rows, cols = tile_grid(config, processor, width, height)
    side = merged_side(config)
    if rows * cols == 1:
        return ImageLayout((GridView("image", side, side),), (int(width), int(height)))
    views = [GridView(f"tile {r + 1},{c + 1}", side, side, (c / cols, r / rows, (c + 1) / cols, (r + 1) / rows))
             for r in range(rows) for c in range(cols)]
    views.append(GridView("thumbnail", side, side))
    return ImageLayout(tuple(views), (int(width), int(height)))


def max_image_tokens(config, processor) -> int:
    """The most tokens one image can take: max_patches tiles and the thumbnail."""
    t = _tiling(config, processor)
    tiles = int(t["max_patches"]) + 1 if t["crop_to_patches"] and int(t["max_patches"]) > 1 else 1
    return tiles * tokens_per_tile(config)


def crop_patches(config, width: int, height: int):
    """No per-patch crop map: the projector reads each 2x2 block of patches concatenated (the pixel shuffle), so
    the vision-side reductions read InternVL's tower per image token (`decoding.internvl_vision`)."""
    raise ValueError("internvl has no per-patch crop map: its vision-side reductions read the tower per "
                     "pixel-shuffled image token (decoding.internvl_vision)")


def pixel_shuffled(config) -> bool:
    """The projector reads the tower's patches pixel-shuffled (each 2x2 block concatenated into one image token):
    VisionZip and Downsample's grid pooling read the tower per image token (`decoding.internvl_vision`)."""
    return True


# -- processors ----------------------------------------------------------------------------------------------------

def image_only_processor_class():
    """InternVLProcessor without its video processor (see the module doc): its image and text handling is the
    released class's own."""
    from transformers import InternVLProcessor

    class ImageOnlyInternVLProcessor(InternVLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, image_seq_length: int = 256, chat_template=None,
                     **kwargs):
            # ProcessorMixin takes its parts (image_processor and tokenizer only) and its saved settings from this
            # signature
            InternVLProcessor.__init__(self, image_processor, tokenizer, None, image_seq_length=image_seq_length,
                                       chat_template=chat_template, **kwargs)

    return ImageOnlyInternVLProcessor


def image_processor_for(config):
    """The PIL backend of GotOcr2's image processor at the model's tile size, tiling on (the released settings:
    1 to 12 tiles, ImageNet's mean and std; the tiny model: up to 4 tiles)."""
    from transformers import GotOcr2ImageProcessorPil

    tile = _side(config.vision_config.image_size)
    most = TINY_MAX_TILES if tile == TINY_TILE else 12
    return GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1,
                                    max_patches=most, image_mean=list(IMAGE_MEAN), image_std=list(IMAGE_STD))


def processor(config, tokenizer, template: str):
    """The processor of a model built in code (the tiny shape, or a released one with a stand-in tokenizer)."""
    return image_only_processor_class()(image_processor=image_processor_for(config), tokenizer=tokenizer,
                                        chat_template=template, image_seq_length=tokens_per_tile(config))


def load_processor(src: str, config, **kw):
    """The checkpoint's processor: transformers' own where it builds (torchvision present), else the same without
    its video processor."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(src, **kw)
    except Exception:  # noqa: BLE001 - no torchvision: the image-only processor from the same files
        return image_only_processor_class().from_pretrained(src, **kw)


# -- tiny models ---------------------------------------------------------------------------------------------------

def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with InternVL's special tokens (ChatML, <img>, </img>, <IMG_CONTEXT>, <video>),
    named as the released tokenizers name them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ..tiny import _CORPUS

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = [ln.strip() for ln in _CORPUS.strip().splitlines() if ln.strip()]
    tk.train_from_iterator(lines * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", extra_special_tokens=dict(EXTRA_SPECIAL),
                                   model_max_length=8192)  # the released tokenizers' (13 tiles: 3,328 tokens)


def tiny_parts(family: str = "internvl", seed: int = 0):
    """(model in float32 eval mode, processor) of a tiny random InternVL."""
    import torch

    from ..families import model_class

    tok = build_tokenizer()
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    cfg = config(family, tiny=True, image_token_id=tok.convert_tokens_to_ids(IMG_CONTEXT),
                 meta={"kind": "tiny", "family": family, "vision_trained": False, "slug": f"tiny-{family}"}, **ids)
    torch.manual_seed(seed)
    model = model_class(cfg)(cfg)
    model.to(torch.float32).eval()
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id = tok.pad_token_id, tok.eos_token_id
    return model, processor(cfg, tok, TEMPLATE)


def save_tiny(path, family: str = "internvl", seed: int = 0) -> str:
    """Write a tiny InternVL as a checkpoint directory laid out as the released one (its processor named by the
    released class), so `load_model(path)` takes the same path as for a hub checkpoint."""
    model, proc = tiny_parts(family, seed)
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    for name in ("processor_config.json", "tokenizer_config.json", "preprocessor_config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as fh:
                data = json.load(fh)
            if "processor_class" in data:
                data["processor_class"] = PROCESSOR_CLASS
            if name == "processor_config.json":  # its tokens a tile (the processor's default is 448 px tiles' 256)
                data["image_seq_length"] = proc.image_seq_length
            with open(file, "w") as fh:
                json.dump(data, fh, indent=2)
    return path


def random_parts(family: str, device, dtype, seed: int = 0):
    """(model with random weights in InternVL3-1B's shape, created on `device` in `dtype`, processor on a
    stand-in tokenizer whose special ids become the model's) for the speed benchmarks."""
    from ..families import model_class
    from ..device import instantiate

    tok = build_tokenizer()
    cfg = config(family, tiny=False, image_token_id=tok.convert_tokens_to_ids(IMG_CONTEXT))
    model = instantiate(model_class(cfg), cfg, device, dtype, seed)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id = tok.pad_token_id, tok.eos_token_id
    return model, processor(cfg, tok, TEMPLATE)
