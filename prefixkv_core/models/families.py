"""The families the engine runs: the registry of every family module (`models/family/`), what each family is,
which transformers class loads it, one checkpoint each.

A family is one module: it lists its `Family` records and the functions that say what differs (see
`family/base.py`). Adding a family is adding its module to `FAMILY_MODULES`. A checkpoint's family follows from
its config: each module says which configs are its own (`family_of`); for the LLaVA families `model_type` picks
the class (llava, llava_next, llava_onevision) and among `llava` checkpoints a SigLIP vision tower marks
LLaVA-Interleave; Qwen2-VL, Qwen2.5-VL and Qwen3-VL are `qwen2_vl`, `qwen2_5_vl` and `qwen3_vl`; InternVL
(InternVL2.5, InternVL3 in transformers' format) is `internvl`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from .errors import ModelLoadError
from .family.base import Family

# The placeholder the LLaVA families' processors expand into their image tokens (prompts, chat templates, tests);
# a family whose processor expands another names it (`image_placeholder`).
IMAGE_TOKEN = "<image>"

FAMILY_MODULES = ("llava", "qwen_vl", "internvl")


def family_module(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.family.{name}")


_MODULES = {name: family_module(name) for name in FAMILY_MODULES}

FAMILY_INFO: dict[str, Family] = {f.key: f for m in _MODULES.values() for f in m.FAMILIES}

# every checkpoint model_type a family module accepts, in registry order
ALL_MODEL_TYPES = tuple(mt for m in _MODULES.values() for mt in m.MODEL_TYPES)
SUPPORTED_MODEL_TYPES = ALL_MODEL_TYPES

LLAVA_FAMILIES = tuple(f.key for f in _MODULES["llava"].FAMILIES)


def hooks(family: str) -> ModuleType:
    """The module that declares what differs for `family` (a key of FAMILY_INFO)."""
    return _MODULES[FAMILY_INFO[family].module]


def supported_text() -> str:
    """One line naming every supported family with its model_type and an example checkpoint."""
    return "; ".join(f"{f.label} (model_type {f.model_type!r}, e.g. {f.example})" for f in FAMILY_INFO.values())


def family_of(config) -> str:
    """The family key of a config (ModelLoadError for a model type no family module takes)."""
    for module in _MODULES.values():
        found = module.family_of(config)
        if found is not None:
            return found
    mt = getattr(config, "model_type", None)
    raise ModelLoadError(f"model_type {mt!r} is not a supported family. Supported: {supported_text()}")


def hooks_of(config) -> ModuleType:
    """The family module of a config."""
    return hooks(family_of(config))


def uses_mrope(config) -> bool:
    """Whether a model of this config takes 3-D rotary positions (Qwen-VL's M-RoPE)."""
    try:
        return FAMILY_INFO[family_of(config)].mrope
    except ModelLoadError:
        return False


def model_class(config):
    """The transformers class that loads a checkpoint of this config."""
    import transformers

    return getattr(transformers, FAMILY_INFO[family_of(config)].model_class)
