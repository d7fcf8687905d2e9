"""The family registry (`models/families.py`): every family module declares every hook, and every registered
family, whatever its module, builds a tiny model whose processor, layout and family agree (parametrised over the
registry, so a new family module is tested here as soon as it is registered)."""
import pytest
import torch

from prefixkv_core import models as M
from prefixkv_core.models import families
from prefixkv_core.models.family.base import Family
from prefixkv_core.testing import build_tiny_family, wide_noise_picture

HOOKS = ("FAMILIES", "MODEL_TYPES", "family_of", "config", "tiny_parts", "save_tiny", "load_processor",
         "chat_template", "image_layout", "max_image_tokens", "crop_patches", "image_placeholder", "image_marker",
         "rope_index", "tower_shared")


@pytest.mark.parametrize("name", families.FAMILY_MODULES)
def test_every_family_module_declares_every_hook(name):
    module = families.family_module(name)
    missing = [hook for hook in HOOKS if not hasattr(module, hook)]
    assert not missing, (name, missing)
    assert all(isinstance(f, Family) and f.module == name for f in module.FAMILIES)
    assert {f.model_type for f in module.FAMILIES} <= set(module.MODEL_TYPES)


def test_the_registry_is_every_module_s_families_once():
    keys = [f.key for name in families.FAMILY_MODULES for f in families.family_module(name).FAMILIES]
    assert len(keys) == len(set(keys)) == len(families.FAMILY_INFO)
    assert set(M.ACCEPTED_MODEL_TYPES) == {f.model_type for f in families.FAMILY_INFO.values()}
    assert families.LLAVA_FAMILIES == M.LLAVA_FAMILIES  # the LLaVA families' own tests keep their set


@pytest.fixture(scope="module", params=list(families.FAMILY_INFO))
def built(request):
    return request.param, build_tiny_family(request.param)


def test_every_registered_family_builds_and_agrees_with_itself(built):
    key, lm = built
    assert lm.family == key and families.family_of(lm.model.config) == key
    assert families.hooks(key) is families.family_module(families.FAMILY_INFO[key].module)
    picture = wide_noise_picture()
    inputs = M.encode(lm, picture, M.format_prompt(lm, "what is it?", True))
    n_image = int(lm.visual_mask(inputs["input_ids"]).sum())
    assert n_image == lm.image_tokens(*picture.size) == lm.image_layout(*picture.size).n_tokens
    assert n_image <= lm.image_seq_length
    with torch.inference_mode():
        rope = families.hooks(key).rope_index(lm.model, inputs["input_ids"], M.vision_inputs(inputs))
    assert (rope is not None) == families.FAMILY_INFO[key].mrope == families.uses_mrope(lm.model.config)
