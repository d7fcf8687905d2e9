"""`load_model(spec)`: the embedded model, a tiny test model, a local directory or a hub id of a supported family:
LLaVA-1.5, LLaVA-Interleave, LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL or InternVL
(`families.FAMILY_INFO`).

Only public transformers APIs are used; everything here targets transformers 5.x.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from .configs import META_KEY, TINY_VARIANTS
from .descriptor import LoadedModel, describe_model
from .device import avoid_cudnn_attention, place_model, resolve_device, resolve_dtype
from .embedded import EMBEDDED_BASE, EMBEDDED_SLUG, _embedded_cache_root, embedded_dir
from .errors import ModelLoadError
from .processor import attach_video_preprocessing, image_only_onevision_processor_class
from .families import SUPPORTED_MODEL_TYPES, model_class, supported_text
from .tiny import TINY_FAMILY_SPECS, TINY_MODEL_SPECS, TINY_NOTE, save_tiny_family, tiny_model_parts

# LLaVA-1.5 / Interleave (llava), LLaVA-NeXT (llava_next), LLaVA-OneVision (llava_onevision), Qwen2-VL (qwen2_vl),
# Qwen2.5-VL (qwen2_5_vl), Qwen3-VL (qwen3_vl), InternVL (internvl); see families.py
ACCEPTED_MODEL_TYPES = SUPPORTED_MODEL_TYPES


def _slug_for(spec: str, config=None) -> str:
    meta = getattr(config, META_KEY, None) if config is not None else None
    if isinstance(meta, dict) and meta.get("slug"):
        return str(meta["slug"])
    p = Path(spec)
    if p.exists():
        parts = p.resolve().parts
        for part in parts:  # a snapshot inside the Hugging Face cache: models--org--name/snapshots/<sha>
            if part.startswith("models--"):
                return re.sub(r"[^A-Za-z0-9._-]+", "-", part[len("models--"):])
        base = p.resolve().name
    else:
        base = spec.strip("/").replace("/", "--")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-") or "model"


def _load_pretrained(
    src: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    multi: bool,
    cache_dir: str | None,
    name: str,
):
    from transformers import AutoConfig

    kw: dict[str, Any] = {}
    if cache_dir is not None:
        kw["cache_dir"] = cache_dir
    try:
        config = AutoConfig.from_pretrained(src, **kw)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(
            f"cannot load a model config from {name!r}: {e}. Accepted: 'embedded', "
            f"{', '.join('tiny-' + v for v in TINY_VARIANTS)}, a local directory or a hub id "
            f"(offline: it must already be in the Hugging Face cache) of a supported family: "
            f"{supported_text()}"
        ) from e
    mt = getattr(config, "model_type", None)
    if mt not in ACCEPTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{name!r} has model_type {mt!r}, which is not a supported family. Supported: {supported_text()}"
        )
    load_kw: dict[str, Any] = dict(dtype=dtype, attn_implementation="sdpa", **kw)
    if multi:
        load_kw["device_map"] = "auto"
    model = model_class(config).from_pretrained(src, config=config, **load_kw)
    if multi:
        device = model.get_input_embeddings().weight.device
    else:
        model = place_model(model, device, dtype)
    try:
        processor = load_processor(src, config, **kw)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{name!r}: cannot load its processor: {e}") from e
    return config, model, processor, device


def load_processor(src: str, config, **kw):
    """The checkpoint's processor. OneVision's is loaded without its video processor (that one needs
    torchvision), which is then attached where it can be built, else its settings (`video.py`)."""
    from transformers import AutoProcessor

    if getattr(config, "model_type", None) not in ("llava", "llava_next", "llava_onevision"):
        from .families import hooks_of

        return hooks_of(config).load_processor(src, config, **kw)
    if getattr(config, "model_type", None) == "llava_onevision":
        return attach_video_preprocessing(image_only_onevision_processor_class().from_pretrained(src, **kw), config,
                                          src)
    return AutoProcessor.from_pretrained(src, **kw)


def load_model(
    spec: str = "embedded", device: str = "auto", dtype: str = "auto", cache_dir: str | None = None
) -> LoadedModel:
    """Load a vision-language model of a supported family (LLaVA-1.5, LLaVA-Interleave, LLaVA-NeXT,
    LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, InternVL) and its processor.

    spec: "embedded" | "embedded-base" (the embedded model as training starts from it: no trained vision, no
          adapter) | "tiny-llama" | "tiny-qwen2" | "tiny-<family>" (tiny-llava-1.5, tiny-llava-interleave,
          tiny-llava-next, tiny-llava-onevision, tiny-qwen2-vl, tiny-qwen2.5-vl, tiny-qwen3-vl, tiny-internvl: a
          tiny random
          model of that family, saved under the cache
          directory and loaded from there like a checkpoint) | a local directory | a hub id.
    device: "auto" (cuda if available, else cpu), "auto-multi" (accelerate device_map="auto"),
            "cpu", "cuda", "cuda:N".  dtype: "auto" (bfloat16 on cuda, float32 on cpu), "float32",
            "float16", "bfloat16".
    cache_dir: for "embedded", where the assembled model is kept (default $PREFIXKV_CACHE or
            ~/.cache/prefixkv); for hub ids, the Hugging Face cache directory.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError("empty model spec; accepted: 'embedded', 'tiny-llama', 'tiny-qwen2', "
                             f"{', '.join(TINY_FAMILY_SPECS)}, a directory or a hub id")
    spec = name = spec.strip()
    dev, multi = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    avoid_cudnn_attention(dev)  # decode timings would measure cuDNN's graph builds (see there)

    if spec.lower() in TINY_MODEL_SPECS:
        variant = "llama" if spec.lower() == "tiny" else spec.lower().split("-", 1)[1]
        model, processor = tiny_model_parts(variant, 0)
        model = place_model(model, dev, dt)
        return describe_model(
            model, processor, name=spec, slug=f"tiny-{variant}", device=dev, dtype=dt,
            vision_trained=False, notes=[TINY_NOTE],
        )

    if spec.lower() in TINY_FAMILY_SPECS:
        family = spec.lower()[len("tiny-"):]
        spec = save_tiny_family(_embedded_cache_root(cache_dir) / "tiny" / family, family)

    if spec.lower() in ("embedded", EMBEDDED_BASE):
        src, vision_trained, notes = embedded_dir(cache_dir, base=spec.lower() == EMBEDDED_BASE)
        _, model, processor, dev = _load_pretrained(
            str(src), device=dev, dtype=dt, multi=multi, cache_dir=None, name=spec
        )
        notes = list(notes) + ["language model: SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)"]
        return describe_model(
            model, processor, name=spec, slug=EMBEDDED_SLUG + ("-base" if spec.lower() == EMBEDDED_BASE else ""),
            device=dev, dtype=dt, vision_trained=vision_trained, notes=notes,
        )

    is_dir = os.path.isdir(spec)
    if not is_dir and (spec.startswith((".", "/", "~")) or os.sep in spec.replace("/", "", 1)):
        raise ModelLoadError(f"model directory {spec!r} does not exist")
    config, model, processor, dev = _load_pretrained(
        spec, device=dev, dtype=dt, multi=multi, cache_dir=None if is_dir else cache_dir, name=name
    )
    meta = getattr(config, META_KEY, None)
    notes: list[str] = []
    vision_trained = True
    if isinstance(meta, dict):
        vision_trained = bool(meta.get("vision_trained", True))
        if meta.get("kind") == "tiny":
            notes.append(TINY_NOTE)
        elif not vision_trained:
            notes.append("vision tower is untrained: the model cannot see images, so answers ignore the image content")
    return describe_model(
        model, processor, name=name, slug=_slug_for(spec, config), device=dev, dtype=dt,
        vision_trained=vision_trained, notes=notes,
    )
